"""The gateway rule behind the chart's admin-key warning (helm/polyroute/templates/NOTES.txt): with
Redis and no POLYROUTE_ADMIN_KEY, only the first gateway to start generates an admin key, into its
own data dir; a second replica on the same Redis, with a data dir of its own (a pod's emptyDir),
generates none. So the key's only copy dies with the first pod. Real gateways, real redis-server.
"""

from __future__ import annotations

import httpx
import redis

from policies import parse_catalog
from tests.conftest import catalog_yaml_for, start_gateway


def test_only_the_first_replica_on_redis_writes_the_generated_admin_key(upstream, redis_server, tmp_path):
    redis.Redis.from_url(redis_server.url).flushdb()
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    first = start_gateway(catalog, tmp_path / "pod-a", admin_key=None, redis_url=redis_server.url)
    try:
        second = start_gateway(catalog, tmp_path / "pod-b", admin_key=None, redis_url=redis_server.url)
        try:
            generated = (tmp_path / "pod-a" / "admin-key").read_text().strip()
            assert not (tmp_path / "pod-b" / "admin-key").exists()
            # the one key is in Redis: it works on pod-b, which never had its plaintext
            listed = httpx.get(second.url + "/admin/keys", headers=second.auth(generated), timeout=60)
            assert listed.status_code == 200, listed.text
            assert len([k for k in listed.json()["data"] if k.get("admin")]) == 1  # one, not one per replica
        finally:
            second.server.stop()
    finally:
        first.server.stop()
