"""`polyroute ingest --encoding`: text files (.txt .md .html) are sent to the gateway as UTF-8.

The gateway decodes text files as UTF-8 (or UTF-16 with a byte-order mark); a file in another
encoding is decoded here with the encoding the user names and sent re-encoded.
"""

from __future__ import annotations

import codecs

from polyroute.ingest_gateway import SUPPORTED

TEXT_SUFFIXES = tuple(s for s in SUPPORTED if s != ".pdf")  # decoded by the gateway as UTF-8 text
BYTE_ORDER_MARKS = (codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # the gateway reads these


class NotDecodable(ValueError):
    """A text file that is not valid text in the encoding it is read in (its message names it)."""


def text_encoding(name: str) -> str | None:
    """The codec's canonical name, or None when Python has no text encoding of that name
    ("base64" is a codec but not a text encoding: bytes.decode refuses it, except for b"")."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        return None
    return info.name if getattr(info, "_is_text_encoding", True) else None


def as_utf8(name: str, data: bytes, encoding: str) -> bytes:
    """A file's bytes as the gateway should get them: text files (.txt .md .html) in UTF-8.

    The gateway decodes text files as UTF-8 (or UTF-16 with a byte-order mark), so a file in another
    encoding is decoded here with `encoding` and sent re-encoded. A file with a byte-order mark, a
    PDF, and a file that is valid UTF-8 text are sent as they are, whatever `encoding` says: a folder
    may mix UTF-8 files with older ones, and reading a UTF-8 file as cp1252 would store mojibake
    without a word. (Bytes with NUL in them are not UTF-8 *text*: UTF-16 without a mark is.)"""
    if not name.lower().endswith(TEXT_SUFFIXES) or data.startswith(BYTE_ORDER_MARKS):
        return data
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        first_error: UnicodeDecodeError | None = exc
    else:
        first_error = None
    if encoding == "utf-8":
        if first_error is None:
            return data  # NUL bytes and all: the gateway says whether it is text
        raise NotDecodable(
            f"{name}: not valid UTF-8 text ({_where(data, first_error)}); if the file is in another "
            "encoding, name it with --encoding (e.g. --encoding cp1252 for Windows files, latin-1, shift_jis)"
        )
    if first_error is None and b"\x00" not in data:
        return data
    try:
        return data.decode(encoding).encode("utf-8")
    except UnicodeError as exc:
        where = _where(data, exc) if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise NotDecodable(
            f"{name}: neither UTF-8 nor {encoding} text ({where}); name the file's encoding with --encoding"
        ) from None


def _where(data: bytes, error: UnicodeDecodeError) -> str:
    return f"byte 0x{data[error.start]:02x} at offset {error.start}"
