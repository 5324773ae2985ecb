"""PII inside an attached PDF: the policy reads the PDF's text layer, as the worker will.

A client attaches a PDF as a base64 data URL (OpenAI's file part and the Responses API's input_file)
or as an Anthropic base64 document. The detector used to decode only UTF-8 payloads, so a PDF that
named a person went out classed public. The PDFs here are real files (tests/fakes/pdf.py) that
pypdf, and a provider, read.
"""

from __future__ import annotations

import base64

import pytest

from policies.detect import decoded_views
from tests.fakes.pdf import text_pdf
from tests.test_every_endpoint import assert_error_format, every_endpoint_gateway, post


def pdf_data_url(*lines: str) -> str:
    return "data:application/pdf;base64," + base64.b64encode(text_pdf(list(lines))).decode()


def test_a_pdf_data_url_is_read_for_detection():
    views = decoded_views(f"see {pdf_data_url('Invoice 42', 'for jane.doe@example.com')} please")
    assert any("jane.doe@example.com" in view for view in views)


@pytest.mark.parametrize(
    "payload",
    [
        text_pdf(["jane.doe@example.com"])[:60],  # truncated: not a readable PDF
        b"%PDF-1.4\nnot really a pdf",
        b"\x89PNG\r\n\x1a\n" + bytes(range(256)),  # an image: no OCR here
    ],
    ids=["truncated-pdf", "garbage-pdf", "png"],
)
def test_unreadable_binary_attachments_are_left_alone(payload):
    url = "data:application/octet-stream;base64," + base64.b64encode(payload).decode()
    assert decoded_views(url) == []


def bodies(url: str, raw_b64: str) -> dict[str, dict]:
    return {
        "chat": {
            "model": "auto",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "summarise the attachment"},
                        {"type": "file", "file": {"filename": "invoice.pdf", "file_data": url}},
                    ],
                }
            ],
        },
        "messages": {
            "model": "auto",
            "max_tokens": 50,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "base64", "media_type": "application/pdf", "data": raw_b64},
                        },
                        {"type": "text", "text": "summarise the document"},
                    ],
                }
            ],
        },
        "responses": {
            "model": "auto",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "summarise the attachment"},
                        {"type": "input_file", "filename": "invoice.pdf", "file_data": url},
                    ],
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def gw(upstream, tmp_path_factory):
    gateway = every_endpoint_gateway(upstream, tmp_path_factory.mktemp("pii-pdf"))
    yield gateway
    gateway.server.stop()


@pytest.mark.parametrize("endpoint", ["chat", "messages", "responses"])
def test_pii_in_an_attached_pdf_stays_off_excluded_workers(gw, upstream, endpoint):
    """With the one admissible (EU) worker failing, the request must fail rather than fall back to
    the CN and US workers: the PDF names a person."""
    pdf = text_pdf(["Invoice 42", "Bill to: jane.doe@example.com"])
    raw = base64.b64encode(pdf).decode()
    upstream.behave("cheap-model", status=500)
    response = post(gw, endpoint, bodies("data:application/pdf;base64," + raw, raw)[endpoint])
    assert response.status_code == 502, response.text
    assert response.headers["x-polyroute-data-class"] == "pii"
    assert_error_format(endpoint, response)
    assert upstream.requests_for("cheap-model")
    assert not upstream.requests_for("mid-model") and not upstream.requests_for("pricey-model")


@pytest.mark.parametrize("endpoint", ["chat", "messages", "responses"])
def test_a_pdf_without_pii_is_not_held_back(gw, upstream, endpoint):
    pdf = text_pdf(["Quarterly report", "Revenue grew in every region."])
    raw = base64.b64encode(pdf).decode()
    response = post(gw, endpoint, bodies("data:application/pdf;base64," + raw, raw)[endpoint])
    assert response.status_code == 200, response.text
    assert response.headers["x-polyroute-data-class"] == "public"
