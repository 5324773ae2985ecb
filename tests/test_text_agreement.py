"""Free-text answers compared by meaning (router/text_agreement.py): keys from embeddings, read by
the planner's evidence the same way live (router/evidence.py) and offline (router/offline/book.py)."""

from __future__ import annotations

import numpy as np
import pytest

from router.answers import Kind
from router.evidence import POSTHOC_FEATURES, posthoc_rows, read_answers
from router.offline.book import AnswerBook
from router.text_agreement import SIMILARITY, embed_and_key, remembering, text_keys

QUESTION = "Explain in one or two sentences what the mitochondria does in a cell."
# Hand-written pairs: a paraphrase, and an answer on the same topic that says something else.
PARAPHRASES = [
    ("Paris is the capital of France.", "The capital city of France is Paris."),
    (
        "The mitochondria produces most of the cell's energy in the form of ATP.",
        "Most of a cell's ATP, its energy currency, is made by the mitochondria.",
    ),
    (
        "You should restart the router and then reconnect to the Wi-Fi network.",
        "Turn the router off and on again, then join the Wi-Fi again.",
    ),
    (
        "Water boils at 100 degrees Celsius at sea level.",
        "At sea level, water reaches its boiling point at 100 °C.",
    ),
    (
        "The French Revolution began in 1789 with the storming of the Bastille.",
        "It started in 1789, when the Bastille was stormed.",
    ),
]
OTHERWISE = [
    ("Paris is the capital of France.", "Lyon is the capital of France."),
    (
        "The mitochondria produces most of the cell's energy in the form of ATP.",
        "The nucleus stores the cell's genetic information as DNA.",
    ),
    (
        "You should restart the router and then reconnect to the Wi-Fi network.",
        "You should replace the network cable and call your provider.",
    ),
    ("Water boils at 100 degrees Celsius at sea level.", "Water freezes at 0 degrees Celsius at sea level."),
    (
        "The French Revolution began in 1789 with the storming of the Bastille.",
        "The French Revolution ended in 1799 when Napoleon took power.",
    ),
]


def unit(*rows: list[float]) -> np.ndarray:
    v = np.asarray(rows, dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_answers_join_the_first_leader_they_are_close_to_and_keys_never_change():
    vectors = unit([1, 0, 0], [0.95, 0.31, 0], [0, 1, 0], [0.05, 1, 0.05])
    texts = ["first answer here", "second answer here", "third answer", "fourth answer"]
    keys = text_keys(texts, vectors)
    assert keys == ["text:0", "text:0", "text:2", "text:2"]
    # a plan that called fewer workers saw the same keys for them: agreement only grows
    for n in range(1, 4):
        assert text_keys(texts[:n], vectors[:n]) == keys[:n]


def test_an_empty_answer_or_a_refusal_agrees_with_nobody():
    vectors = unit([1, 0], [1, 0], [1, 0])
    keys = text_keys(["I'm sorry, I can't help with that.", "   ", "The answer is ATP."], vectors)
    assert keys == [None, None, "text:2"]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="2 answers but 1 vectors"):
        text_keys(["a b", "c d"], unit([1, 0]))
    with pytest.raises(ValueError, match="similarity"):
        text_keys(["a b"], unit([1, 0]), similarity=0)


def test_only_keyable_answers_are_embedded():
    seen: list[list[str]] = []

    def embed(texts: list[str]) -> np.ndarray:
        seen.append(texts)
        return unit(*([1.0, 0.0] for _ in texts))

    assert embed_and_key(["", "Sorry, I cannot do that.", "It makes ATP.", "ATP is made there."], embed) == [
        None,
        None,
        "text:2",
        "text:2",
    ]
    assert seen == [["It makes ATP.", "ATP is made there."]]
    assert embed_and_key(["", ""], embed) == [None, None] and len(seen) == 1  # nothing to embed


def test_a_plan_embeds_each_answer_once_over_its_rounds():
    seen: list[list[str]] = []

    def embed(texts: list[str]) -> np.ndarray:
        seen.append(texts)
        return unit(*([1.0, float(len(t))] for t in texts))

    once = remembering(embed)
    first = embed_and_key(["It makes ATP.", "ATP is made there."], once)
    second = embed_and_key(["It makes ATP.", "ATP is made there.", "The nucleus holds DNA, mostly."], once)
    assert second[:2] == first  # the same vectors, so the same keys, for the answers already held
    assert seen == [["It makes ATP.", "ATP is made there."], ["The nucleus holds DNA, mostly."]]
    assert np.allclose(once(["It makes ATP."]), embed(["It makes ATP."]))


def test_the_planner_reads_agreeing_free_text_as_agreement():
    texts = ["The mitochondria makes most of the cell's ATP.", "It produces the cell's energy as ATP.",
             "It stores the genetic information of the cell."]  # fmt: skip
    keys = ["text:0", "text:0", "text:2"]
    read = read_answers(QUESTION, texts, text_keys=keys)
    assert read.kind is Kind.TEXT and list(read.keys) == keys
    rows = posthoc_rows(read, range(3), [0.0, 0.0, 0.0])
    agreeing = rows[:, POSTHOC_FEATURES.index("agreeing")]
    assert agreeing.tolist() == [1.0, 1.0, 0.0]
    # without meaning keys free text agrees with nobody, as before
    plain = posthoc_rows(read_answers(QUESTION, texts), range(3), [0.0, 0.0, 0.0])
    assert plain[:, POSTHOC_FEATURES.index("agreeing")].tolist() == [0.0, 0.0, 0.0]


def test_the_offline_book_keys_free_text_like_the_gateway():
    answers = [
        "The mitochondria makes most of the cell's ATP.",
        "It stores the genetic information of the cell.",
        "It produces the cell's energy as ATP.",
    ]
    vectors = {answers[0]: [1.0, 0.0], answers[1]: [0.0, 1.0], answers[2]: [0.9, 0.2]}

    def embed(texts: list[str]) -> np.ndarray:
        return unit(*(vectors[t] for t in texts))

    book = AnswerBook([QUESTION], [answers], embed=embed)
    for members in ([0], [0, 1], [0, 2], [2, 1, 0]):
        held = [answers[j] for j in members]
        live = read_answers(QUESTION, held, text_keys=embed_and_key(held, embed))
        assert book.read(0, members).keys == live.keys
    assert book.read(0, [0, 2]).keys == ("text:0", "text:0")


@pytest.mark.slow
def test_minilm_keys_paraphrases_together_and_other_claims_apart():
    """The sanity check behind the default threshold, with the real model (loads MiniLM)."""
    from retrieval.embed import shared_embedder

    embed = shared_embedder("minilm").encode
    for a, b in PARAPHRASES:
        assert embed_and_key([a, b], embed) == ["text:0", "text:0"], (a, b)
    for a, b in OTHERWISE:
        assert embed_and_key([a, b], embed) == ["text:0", "text:1"], (a, b)
    assert SIMILARITY == 0.80
