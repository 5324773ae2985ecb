"""`python -m router.offline --out-json R.json`: the RouteLLM harness with the group-mean reference router."""

from router.offline.harness import main

main()
