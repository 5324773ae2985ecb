"""Answers made comparable: what kind of answer a query asks for, and each answer's canonical key.

A cascade decides from answers, not only from the query: two workers that give the same choice
letter, the same final number or the same short span are more often right than either alone. To
count agreement, answers are first normalised by their kind, detected from the query (and the
answers themselves when the query says little):

| kind     | detected by                                                | key                              |
|----------|------------------------------------------------------------|----------------------------------|
| choice   | the query lists options (`A) …`, `(B) …`, `C. …`)          | the chosen letter                |
| code     | the query asks for a function/program, or answers hold code | the main function, canonicalised |
| number   | the query asks how many/much or to compute, answers end in a number | the final number, canonical |
| span     | short answers (a few words)                                | lower-case, no articles/punctuation |
| text     | anything else                                              | none: agrees with nobody (no embedding comparison yet) |

The same functions run live (the planner in the gateway) and offline (the replay that evaluates
it), so what is measured is what runs. Pure Python, no model: cheap enough for every step.
"""

from __future__ import annotations

import ast
import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    CHOICE = "choice"
    CODE = "code"
    NUMBER = "number"
    SPAN = "span"
    TEXT = "text"


# ---- detection ------------------------------------------------------------------------------------
# Leading indentation is `[^\S\n]*` (white space but not a line end), never `\s*`: under MULTILINE a
# `^\s*` tried at every line start of a run of blank lines rescans the whole run each time (quadratic).
_OPTION_LINE = re.compile(r"^[^\S\n]*\(?([A-J])[\).:]\s+\S", re.MULTILINE)
_DEF_LINE = re.compile(r"^[^\S\n]*def \w+\(", re.MULTILINE)
_CODE_ASK = re.compile(
    r"\b(write|implement|complete|define|create)\b[^.?!\n]{0,60}\b(function|program|script|class|method|code)\b"
    r"|\bpython\b|```|^[^\S\n]*def \w+\(",
    re.IGNORECASE | re.MULTILINE,
)
_NUMBER_ASK = re.compile(
    r"\bhow (many|much|long|far|old|often)\b|\b(calculate|compute|what is the (total|sum|value|number|"
    r"product|difference|result|area|average|cost|price))\b|\bwhat percent",
    re.IGNORECASE,
)
SPAN_MAX_WORDS = 6


def choice_letters(query: str) -> str:
    """The option letters a multiple-choice query offers, in order ("ABCD"), or "" if it offers none.

    Few-shot prompts repeat the options of earlier examples: only the last run of consecutive letters
    from A counts (the question actually asked)."""
    letters = [m.group(1) for m in _OPTION_LINE.finditer(query)]
    last: list[str] = []
    for letter in letters:
        if letter == "A":
            last = ["A"]
        elif last and ord(letter) == ord(last[-1]) + 1:
            last.append(letter)
    return "".join(last) if len(last) >= 2 else ""


def _looks_like_code(answer: str) -> bool:
    return "```" in answer or "[PYTHON]" in answer or bool(_DEF_LINE.search(answer))


def detect_kind(query: str, answers: Sequence[str] = ()) -> Kind:
    """The kind of answer `query` asks for; `answers` (any seen so far) settle unclear queries."""
    if choice_letters(query):
        return Kind.CHOICE
    if _CODE_ASK.search(query) or (answers and sum(map(_looks_like_code, answers)) * 2 > len(answers)):
        return Kind.CODE
    numbers_in_query = len(NUMBER.findall(query))
    if numbers_in_query and _NUMBER_ASK.search(query):
        return Kind.NUMBER
    if numbers_in_query >= 2 and query.rstrip().endswith("?"):  # a word problem: "what's her salary?"
        if not answers or all(final_number(a) is not None for a in answers):
            return Kind.NUMBER
    if answers:
        finals = [final_number(a) for a in answers]
        if sum(f is not None and "####" in a for f, a in zip(finals, answers, strict=True)) * 2 > len(
            answers
        ):
            return Kind.NUMBER
        if max(len(a.split()) for a in answers) <= SPAN_MAX_WORDS:
            return Kind.SPAN
    return Kind.TEXT


# ---- keys -----------------------------------------------------------------------------------------
# Every reader below is linear in the answer's length (answers are untrusted and read on the event
# loop): no two quantifiers can take the same characters (`\s*` runs are separated by a required
# token), and a letter alone on a line is found line by line, not by a MULTILINE `^\s*…\s*$`.
AFTER_LETTER = r"(?![A-Za-z0-9_'’])"  # "B" but not "Based", "B2" or "I'm"
_MARKED = r"\s*(?:(?i:is)\s*)?(?::\s*)?\**([\(\[]?)([A-Ja-j])" + AFTER_LETTER
ANSWER_MARK = re.compile(r"\b(?i:answer)" + _MARKED)  # "The answer is (B)", "Answer: **C**", "answer: d"
_OPTION_MARK = re.compile(r"\b(?i:option|choice)" + _MARKED)  # "the best option is C"
_ALONE_AFTER = re.compile(r"[^\S\n]*(?:[\)\]\.:,;!?*]|\n|$)")  # nothing but punctuation after it
_LEADING = re.compile(r"\s*[\(\[]?([A-J])(?:[\)\]\.:,]|\s|$)")  # "B", "B)", "(B)", "B. iron", "A questioning"
_LISTED_AFTER = re.compile(r"[\)\]]?\s*(?:,|/|&|\bor\b|\band\b)\s*[\(\[]?[A-J]" + AFTER_LETTER)  # "A or B"
WRAPPER = re.compile(r"\\[A-Za-z]+\{([^{}]*)\}")  # \text{B}, \textbf{B}, \mathrm{B}
BOXED_OPTION = re.compile(r"[\(\[]?([A-Ja-j])(?:[\)\]\.:]|$)")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    begin = i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin : i - 1] if depth == 0 else None


def _boxed_letter(answer: str) -> str | None:
    """`\\boxed{B}`, `\\boxed{\\text{(B)}}`, `\\boxed{B) iron}`: how reasoning models end."""
    boxed = last_boxed(answer)
    if boxed is None:
        return None
    core = WRAPPER.sub(r"\1", boxed).strip(" $*\t\n")
    found = BOXED_OPTION.match(core)
    return found.group(1).upper() if found else None


def marked_letter(found: re.Match[str]) -> str | None:
    """The letter after a marker; a lower-case one only when it cannot be a word: "answer: d" and
    "answer is (a)" name a letter, "the answer is a drought" does not."""
    bracket, letter = found.group(1), found.group(2)
    if letter.islower() and not bracket and not _ALONE_AFTER.match(found.string, found.end()):
        return None
    return letter.upper()


def _last_answer_mark(answer: str) -> str | None:
    """The letter of the last "answer is X" / "Answer: X": a worker that corrects itself ends with it."""
    last = None
    for found in ANSWER_MARK.finditer(answer):
        last = marked_letter(found) or last
    return last


def _first_option_mark(answer: str) -> str | None:
    return next((letter for f in _OPTION_MARK.finditer(answer) if (letter := marked_letter(f))), None)


def _leading_letter(answer: str) -> str | None:
    """The letter the answer starts with, unless a list of letters starts it ("A or B", "B and C are
    both plausible"): several letters are no choice."""
    found = _LEADING.match(answer)
    if found is None or _LISTED_AFTER.match(answer, found.end(1)):
        return None
    return found.group(1)


def _lone_line_letter(answer: str) -> str | None:
    """The first line that holds only a letter (markdown stars allowed: "**C**"), or None."""
    for line in answer.splitlines():
        core = line.strip().strip("*").strip()
        if len(core) == 1 and "A" <= core <= "J":
            return core
    return None


# In order of trust: an explicit final answer wins over a leading word that may be the article "A".
_CHOICE_READERS = (_boxed_letter, _last_answer_mark, _leading_letter, _first_option_mark, _lone_line_letter)


def choice_key(answer: str, letters: str = "ABCDE") -> str | None:
    """The letter chosen, if it is one the query offered: "D", "D)", "(D)", "D. iron", "The answer is
    D", "Answer: (D)", "\\boxed{D}". Words that start with a capital letter ("Based on", "Erin") are
    not letters; an explicit final answer ("… so the answer is B") wins over a leading article ("A
    drought …"); a lower-case "a" counts only in a marker form ("answer: a", "answer is (a)"); a
    leading list of letters ("A or B") chooses none."""
    for reader in _CHOICE_READERS:
        letter = reader(answer)
        if letter is not None and letter in letters:
            return letter
    return None


NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def final_answer(text: str) -> str | None:
    """The answer's final value as written: after '####' or 'answer is', else its last number, else
    its last line (lower-case). Used where a non-numeric final answer still counts (self-consistency)."""
    for marker in ("####", "answer is", "Answer:"):
        if marker in text:
            tail = text.rsplit(marker, 1)[1]
            found = NUMBER.search(tail)
            if found:
                return found.group().replace(",", "").rstrip(".")
            stripped = tail.strip().split("\n")[0].strip(" .*")
            if stripped:
                return stripped.lower()
    numbers = NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(",", "").rstrip(".")
    stripped = text.strip().split("\n")[-1].strip(" .*").lower()
    return stripped or None


def canonical_number(raw: str) -> str | None:
    """ "1,234.50" → "1234.5", "18.0" → "18", "-3" → "-3"; None for what is not a finite number."""
    try:
        value = float(raw.replace(",", "").rstrip("."))
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    if value.is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def final_number(text: str) -> str | None:
    """The final number of a worked answer, canonical (see `final_answer`); None if it ends in words."""
    final = final_answer(text)
    return canonical_number(final) if final is not None else None


# One `[ \t]*` on each side of the language tag, the second only after a tag: two adjacent runs that
# could share the same blanks would backtrack quadratically on a fence followed by many spaces.
FENCE = re.compile(r"```[ \t]*(?:(?:python3|python|py)[ \t]*)?\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_TAGGED = re.compile(r"\[PYTHON\](.*?)(?:\[/PYTHON\]|$)", re.DOTALL)
# A function answer is a few KB; a block far longer is not parsed (parsing is not free on the event loop).
MAX_SOURCE_CHARS = 100_000


def parse_python(source: str) -> ast.Module | None:
    """`source` parsed, or None when it is not Python we can read. Never raises: deep nesting
    ("-" * 20000 + "1") makes CPython's parser raise MemoryError or RecursionError, not SyntaxError,
    and a null byte raises ValueError; each is an answer that is not code, not a crash."""
    if len(source) > MAX_SOURCE_CHARS:
        return None
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def python_source(answer: str) -> str | None:
    """The Python code of an answer: fenced or [PYTHON]-tagged blocks, else the answer itself when it
    parses; None when no Python is found (a JavaScript answer to a Python task is not Python)."""
    blocks = FENCE.findall(answer) or _TAGGED.findall(answer)
    candidates = blocks or [answer]
    for block in candidates:
        source = block.strip("\n")
        tree = parse_python(source)
        if tree is not None and any(isinstance(node, ast.FunctionDef | ast.ClassDef) for node in tree.body):
            return source
    return None


class _Canonical(ast.NodeTransformer):
    """Names the main function `f` and its parameters `a0, a1, …`; drops docstrings."""

    def __init__(self, main: str, params: list[str]) -> None:
        self.names = {main: "f", **{p: f"a{i}" for i, p in enumerate(params)}}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = self.names.get(node.id, node.id)
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.arg = self.names.get(node.arg, node.arg)
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.name = self.names.get(node.name, node.name)
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
        ):
            if isinstance(body[0].value.value, str) and len(body) > 1:
                node.body = body[1:]
        node.returns = None
        self.generic_visit(node)
        return node


def code_key(answer: str) -> str | None:
    """The answer's first top-level function, canonical: the same code under other names, with other
    comments or docstrings, gets the same key. Top-level example calls and prints are left out."""
    source = python_source(answer)
    if source is None:
        return None
    tree = parse_python(source)
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)] if tree else []
    if not functions:
        return None
    main = functions[0]
    params = [a.arg for a in main.args.args]
    try:  # the visitor and unparse recurse per nesting level: a 400-term sum exceeds Python's limit
        canonical = _Canonical(main.name, params).visit(main)
        return ast.unparse(ast.fix_missing_locations(canonical))
    except (RecursionError, MemoryError):
        return None  # no key: it agrees with nobody, as an answer without code


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def span_key(answer: str) -> str | None:
    """SQuAD-style: lower case, no punctuation, no articles, single spaces."""
    text = " ".join(_ARTICLES.sub(" ", answer.lower().translate(_PUNCT)).split())
    return text or None


def answer_key(answer: str, kind: Kind, letters: str = "ABCDE") -> str | None:
    """The canonical key agreement is counted on; None when the answer has none of its kind's form
    (which is itself a signal: a refusal or an off-format answer)."""
    if kind is Kind.CHOICE:
        return choice_key(answer, letters or "ABCDE")
    if kind is Kind.NUMBER:
        return final_number(answer)
    if kind is Kind.CODE:
        return code_key(answer)
    if kind is Kind.SPAN:
        return span_key(answer)
    return None


# ---- form -----------------------------------------------------------------------------------------
REFUSALS = re.compile(
    r"^\s*(i('m| am) (sorry|not able|unable)|i (cannot|can't|can not|do not|don't|won't)|unfortunately|"
    r"as an ai|i apologi[sz]e|there is no|sorry)",
    re.IGNORECASE,
)
HEDGES = ("however", "actually", "assume", "approximately", "unclear", "not sure", "might", "perhaps", "wait")


@dataclass(frozen=True, slots=True)
class Form:
    """What an answer's shape says, whatever the task: its length, whether it refuses or hedges, and
    whether it has the form its kind asks for (a letter for a choice, Python for code...)."""

    log_chars: float
    refusal: bool
    hedges: int
    well_formed: bool

    def vector(self) -> list[float]:
        return [self.log_chars, float(self.refusal), float(self.hedges), float(self.well_formed)]


def form(answer: str, key: str | None) -> Form:
    lowered = answer.lower()
    return Form(
        log_chars=math.log1p(len(answer)),
        refusal=bool(REFUSALS.search(answer)),
        hedges=sum(lowered.count(h) for h in HEDGES),
        well_formed=key is not None,
    )


def agreement(keys: Sequence[str | None]) -> Counter[str]:
    """How many answers share each key (answers without a key agree with nobody)."""
    return Counter(k for k in keys if k is not None)
