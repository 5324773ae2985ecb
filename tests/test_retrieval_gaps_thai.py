"""Thai, Lao, Khmer and Burmese are written without spaces between words (retrieval/text.py).

BM25 split text at `\\w` runs: a Thai combining vowel or tone mark is not a word character, so a
Thai sentence broke at every such mark into fragments that straddled words ("เมืองหลวง", capital,
became "เม" + "องหลวง", and in a sentence "นเม" + "องหลวงของประเทศไทย"): searching a word found
nothing. Chunking counted a run of up to 40 characters as one word: a chunk was ~8,000 Thai
characters and a 12-word title ~500. Now a run of these scripts gives overlapping pairs of
character clusters, and up to four clusters (about a word) are one chunking unit.
Through the gateway's HTTP routes on the embedded Qdrant Edge store, and the text module directly.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator

import httpx
import pytest

from retrieval import DocumentInput, RetrievalConfig, Retriever
from retrieval.text import chunk_text, clip_words, content_hash, tokenize
from tests.conftest import Gateway, catalog_yaml_for, start_gateway

# "Thailand has seventy-seven provinces. Bangkok is the capital of Thailand." and others
THAI_CAPITAL = "ประเทศไทยมีจังหวัดทั้งหมดเจ็ดสิบเจ็ดจังหวัด กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย"
THAI_FOOD = "ต้มยำกุ้งเป็นอาหารไทยที่มีรสเปรี้ยวและเผ็ด นิยมรับประทานกับข้าวสวย"
THAI_RAIN = "ฤดูฝนในภาคใต้เริ่มตั้งแต่เดือนพฤษภาคมจนถึงเดือนตุลาคม ฝนตกหนักเกือบทุกวัน"


@pytest.fixture(scope="module")
def tgw(upstream, tmp_path_factory) -> Iterator[Gateway]:
    from policies import parse_catalog

    gw = start_gateway(
        parse_catalog(catalog_yaml_for(upstream.url), "test catalog"),
        tmp_path_factory.mktemp("retrieval_gaps_thai"),
        retrieval_embedder="minilm-static",
        retrieval_chunk_words=40,
        retrieval_chunk_overlap=8,
    )
    yield gw
    gw.server.stop()


def search(gw: Gateway, collection: str, query: str, mode: str) -> list[dict]:
    answer = httpx.post(
        f"{gw.v1}/collections/{collection}/search",
        headers=gw.auth(),
        json={"query": query, "top_k": 3, "mode": mode},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["data"]


def test_searching_a_thai_word_finds_the_document_that_holds_it(tgw: Gateway):
    documents = [
        {"id": "capital", "text": THAI_CAPITAL},
        {"id": "food", "text": THAI_FOOD},
        {"id": "rain", "text": THAI_RAIN},
    ]
    answer = httpx.post(
        f"{tgw.v1}/collections/thai/documents", headers=tgw.auth(), json={"documents": documents}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    for query, expected in (("เมืองหลวง", "capital"), ("อาหาร", "food"), ("ฤดูฝน", "rain")):
        for mode in ("bm25", "bm25_dense"):
            hits = search(tgw, "thai", query, mode)
            assert hits, (query, mode)
            assert hits[0]["document_id"] == expected, (query, mode, hits)
            assert hits[0]["bm25_score"] and hits[0]["bm25_score"] > 0, (query, mode, hits[0])
        # a document sharing only a pair or two with the word ranks well below the one that holds it
        hits = search(tgw, "thai", query, "bm25")
        assert all(h["bm25_score"] < hits[0]["bm25_score"] / 2 for h in hits[1:]), (query, hits)


def test_a_thai_document_sent_again_is_rewritten_once_with_the_new_tokens(tmp_path):
    """A Thai document stored before this change holds the old tokens, which no query now matches:
    its content hash (the formula the previous code used, below) now differs, so sending it again
    rewrites it instead of answering "unchanged"; an English document's hash is as before (no
    collection is rewritten for this), and a Thai one sent twice now is "unchanged" the second time."""
    retriever = Retriever(RetrievalConfig(root=tmp_path / "retrieval", embedder="minilm-static"))
    collection = retriever.get("acme", "thai-again", create=True)
    config = collection.retriever.config
    doc, digest, _ = collection.prepare(DocumentInput("d", THAI_FOOD))
    old_digest = content_hash(
        doc.title,
        doc.text,
        "{}",
        f"{config.chunk_words}/{config.chunk_overlap}/{collection.meta['embedder']}",
    )
    assert digest != old_digest
    english, english_digest, _ = collection.prepare(DocumentInput("e", "Plain English text stays as it was."))
    assert english_digest == content_hash(
        english.title,
        english.text,
        "{}",
        f"{config.chunk_words}/{config.chunk_overlap}/{collection.meta['embedder']}",
    )
    statuses = [collection.ingest([DocumentInput("d", THAI_FOOD)])[0].status for _ in range(2)]
    assert statuses == ["created", "unchanged"]
    retriever.close()


def test_thai_tokens_are_cluster_pairs_that_a_word_shares_with_its_sentence():
    word = tokenize("เมืองหลวง")
    assert word == ["เมื", "มือ", "อง", "งห", "หล", "ลว", "วง"]  # a mark never stands alone
    assert set(word) <= set(tokenize(THAI_CAPITAL))
    assert not set(tokenize("เมืองหลวง")) <= set(tokenize(THAI_FOOD))
    # Lao, Khmer, Burmese: the same rule (a Khmer subscript stays with its cluster's pair)
    assert tokenize("ພາສາລາວ") == ["ພາ", "າສ", "ສາ", "າລ", "ລາ", "າວ"]
    assert set(tokenize("ខ្មែរ")) <= set(tokenize("ភាសាខ្មែរ"))
    assert set(tokenize("ဘာသာ")) <= set(tokenize("မြန်မာဘာသာ"))
    # English tokens are as before; Chinese ones are character pairs too
    assert tokenize("The capital of Thailand, 中文句子") == ["capit", "thailand", "中文", "文句", "句子"]


def test_thai_text_is_chunked_by_about_a_word_and_never_splits_a_letter_from_its_marks():
    text = " ".join([THAI_CAPITAL, THAI_FOOD, THAI_RAIN] * 6)  # ~1,150 characters, 17 runs
    chunks = chunk_text(text, max_words=40, overlap_words=8)
    assert len(chunks) > 3, [len(c.text) for c in chunks]  # as 40-character units it was one chunk
    assert all(len(c.text) <= 40 * 4 * 3 for c in chunks)
    for chunk in chunks:
        assert not unicodedata.category(chunk.text[0]).startswith("M"), chunk.text[:5]
    title = clip_words(THAI_CAPITAL, 3)
    assert title.endswith(" …") and len(title) < 40, title


# Chinese and Japanese: a clause was one BM25 token, so a word searched for matched no sentence that
# holds it among other characters. Now overlapping character pairs, as for Thai.
CJK_DOCUMENTS = [
    {"id": "beijing", "text": "北京是中国的首都，也是政治和文化中心。"},
    {"id": "tea", "text": "中国人喜欢喝绿茶，茶文化历史悠久。"},
    {"id": "tokyo", "text": "東京タワーは東京の港区にある電波塔です。"},
]


def test_searching_a_chinese_or_japanese_word_finds_the_document_that_holds_it(tgw: Gateway):
    answer = httpx.post(
        f"{tgw.v1}/collections/cjk/documents",
        headers=tgw.auth(),
        json={"documents": CJK_DOCUMENTS},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    for query, expected in (("首都", "beijing"), ("绿茶", "tea"), ("電波塔", "tokyo")):
        hits = search(tgw, "cjk", query, "bm25")
        assert hits and hits[0]["document_id"] == expected, (query, hits)
        assert hits[0]["bm25_score"] > 0
    assert tokenize("北京是中国的首都") == ["北京", "京是", "是中", "中国", "国的", "的首", "首都"]
    assert tokenize("首都") == ["首都"]
