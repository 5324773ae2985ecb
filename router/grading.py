"""Graders for calibration probes: an answer and its gold → a score in [0, 1], what was read, and why.

One grader per answer type (router/probes), each reading answers the way workers actually write them:

| type   | reads                                                         | score                        |
|--------|---------------------------------------------------------------|------------------------------|
| choice | the chosen letter ("C", "(C)", "The answer is C", "**C**", `\\boxed{C}`, a closing line "**C) Jupiter**") | 1 if it is the gold letter |
| number | `\\boxed{..}`, else after "Answer:"/"**Answer**:"/"####"/"answer is", else the last number; fractions, `1\\,234` too, and `1 234` after a marker | 1 if equal within `rel_tol` |
| match  | the answer, SQuAD-normalised (case, punctuation, articles, accents) | 1 if an accepted answer appears in it, else token F1 (`partial: f1`) or 0 |
| code   | the answer's Python (its fenced blocks joined, or the whole answer) | 1 if every test passes, else 0 |

Code runs in router/code_behaviour.py's sandbox: a separate `python -P -s -S -B` interpreter (stdlib
only, no site or user paths, not the current directory) with a clean environment (PATH and
PYTHONHASHSEED only), in a fresh temporary directory, with limits on memory, CPU, open files, file
size and processes (none: no fork, no thread), a timer per statement and a kill of its whole process
group at the timeout. As root it runs as nobody; otherwise this process makes itself non-dumpable, so
that a child of its uid cannot read its environment (the workers' keys). An answer that loops,
crashes or exits scores 0. It is a guard against mistakes and casual snooping, not a security
boundary against a determined answer (see that module).

Pure functions; reading an answer never raises (a grader that cannot read an answer scores it 0
and says so in `detail`). Shared readers (choice letters, span normalisation, Python extraction)
come from router/answers.py, so a letter is read the same way here and in the cascade. What only a
grader reads is here, on top of them: a closing option line ("**C) Jupiter**" after the reasoning)
and code split over several fenced blocks (an import or a helper, then the function). They stay
out of router/answers.py on purpose: its readers also serve the live planner and the offline
evaluation, whose published figures and code-run cache depend on them as they are.
"""

from __future__ import annotations

import ast
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.answers import FENCE, choice_key, last_boxed, parse_python, python_source, span_key
from router.code_behaviour import run_behaviour

if TYPE_CHECKING:
    from router.probes import Probe

CODE_TIMEOUT_S = 15.0  # the whole test run of one answer
CODE_PER_CALL_S = 3.0  # one statement or one test: generous, the machine may be busy


@dataclass(frozen=True, slots=True)
class Grade:
    score: float  # 0..1
    extracted: str | None  # what the grader read from the answer (a letter, a number, ...)
    detail: str  # for people: why this score


# ---- choice -----------------------------------------------------------------------------------------
_MARKDOWN = re.compile(r"[*_`]+")
_BRACKETED = re.compile(r"[\(\[]([A-J])[\)\]]")
_OPTION_LINE = re.compile(r"[\(\[]?([A-J])\)")  # a line that starts "C)" or "(C)": an option as listed
_OPTION_NAMED = re.compile(r"(?<![A-Za-z0-9])[\(\[]?([A-J])\)")


def _closing_option(plain: str, letters: str) -> str | None:
    """The letter of the answer's last line when that line starts with an option letter and a
    closing paren ("The largest planet is Jupiter.\n\nC) Jupiter"), names no other option ("(A) or
    (B)") and the line before it is no option line (a listing of the options chooses none)."""
    lines = [line.strip() for line in plain.splitlines() if line.strip()]
    if not lines or (found := _OPTION_LINE.match(lines[-1])) is None or found.group(1) not in letters:
        return None
    if {m.group(1) for m in _OPTION_NAMED.finditer(lines[-1])} != {found.group(1)}:
        return None
    if len(lines) > 1 and _OPTION_LINE.match(lines[-2]):
        return None
    return found.group(1)


_BARE_OPTION = re.compile(r"(?<![A-Za-z0-9(\[])([A-J])\)")  # "C)" as options are listed, not "(C)"


def _walks_through_options(plain: str, letters: str) -> bool:
    """The answer goes through the options in order ("A) Mars is rocky. B) Venus is hot. C) Jupiter
    is the largest."): the first options, up to three, are named as listed, in order. Its leading "A)"
    is where the listing starts, not a choice."""
    named = list(dict.fromkeys(m.group(1) for m in _BARE_OPTION.finditer(plain)))
    first = letters[: min(3, len(letters))]
    return len(first) >= 2 and "".join(named[: len(first)]) == first


def chosen_letter(answer: str, letters: str) -> str | None:
    """The option chosen: router.answers.choice_key on the answer without markdown emphasis
    ("The answer is: **C**", "**Final Answer** \\boxed{C}"), else a closing option line ("… so it
    is Jupiter.\n\n**C) Jupiter**"), else the one offered letter the answer names in brackets ("I'd
    pick (C) iron", "The answer is a drought (C)"); None when it names none or several ("A or B"),
    or when it walks through the options in order without marking one ("A) Mars is rocky. B) …")."""
    plain = _MARKDOWN.sub("", answer or "").replace("is:", "is")
    if _walks_through_options(plain, letters):  # only a marker ("so the answer is C") chooses
        plain = _BARE_OPTION.sub(" ", plain)
    if len(plain.strip(" .\n")) == 1 and plain.strip(" .\n").upper() in letters:
        return plain.strip(" .\n").upper()  # a lone letter, even lower case
    chosen = choice_key(plain, letters) or _closing_option(plain, letters)
    if chosen is not None:
        return chosen
    named = {m.group(1) for m in _BRACKETED.finditer(plain) if m.group(1) in letters}
    return named.pop() if len(named) == 1 else None


def grade_choice(answer: str, gold: str, letters: str = "ABCD") -> Grade:
    chosen = chosen_letter(answer, letters)
    if chosen is None:
        return Grade(0.0, None, f"no option letter ({letters}) found")
    right = chosen == gold
    return Grade(1.0 if right else 0.0, chosen, f"chose {chosen}, gold {gold}")


# ---- number -----------------------------------------------------------------------------------------
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{\s*(-?\d+(?:\.\d+)?)\s*\}\{\s*(\d+(?:\.\d+)?)\s*\}$")
_SHORT_FRAC = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")  # \frac32
_SLASH = re.compile(r"^(-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)$")
_PLAIN = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?$", re.IGNORECASE)
# A unit with its power: "12\\text{ cm}^2" is 12 (square centimetres), not 12^2 and not 2.
_TEXT = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?")
# One number as written in an answer: a LaTeX fraction, a/b, or a decimal with thousands separators.
_TOKEN = re.compile(
    r"-?\\[dt]?frac\{\s*-?\d+(?:\.\d+)?\s*\}\{\s*\d+(?:\.\d+)?\s*\}"
    r"|-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"|-?\.\d+"
)
# "Answer:", "answer is", "**Answer**: 7", "__Answer__: 7", "Answer — 7", "####": markdown emphasis may
# close between the word and its colon.
_MARKER = re.compile(r"(?<![a-z])answer[*_]*\s*(?:is\b|[:\u2014\u2013])|####", re.IGNORECASE)
# A thousands separator inside a number: LaTeX's thin and other spaces (1\,234, 1\;234, 1\ 234, 1~234)
# and the Unicode thin, narrow no-break and no-break spaces (SI style): otherwise 1 and 234 are read.
_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,;: !]|~|[\u2009\u202f\u00a0])(?=\d{3}(?!\d))")


# "1 234" with plain spaces (SI style) is one number only where an answer states its final number:
# right after "Answer:"/"####" (a box's content is read whole already). In prose "3 100" is as often
# two numbers, so elsewhere the last number is read as before.
_SPACED_GROUPS = re.compile(r"(-?\d{1,3}(?: \d{3})+(?:\.\d+)?)(?![\d.,-]?\d)(?!\s*[-/])")


def parse_number(text: str) -> float | None:
    """A number as a final answer writes it: "18", "-0.5", "1,234", "$20,000.", "3/4", "\\frac{3}{4}",
    "\\dfrac32", "45\\%", "12 \\text{cm}", "12\\text{ cm}^2", "10{,}000", "−5" (Unicode minus); None when
    it is something else (an expression, words)."""
    t = _TEXT.sub("", _plain_signs(text or "")).strip()
    for noise in ("\\$", "$", "\\!", "\\,", "\\%", "%", "^\\circ", "^{\\circ}", "\\left", "\\right", "**"):
        t = t.replace(noise, "")
    t = t.replace(",", "").replace(" ", "").rstrip(".").strip("()")
    found = _FRAC.match(t) or _SHORT_FRAC.match(t)
    if found:
        numerator, denominator = float(found.group(2)), float(found.group(3))
        value = numerator / denominator if denominator else None
        return -value if value is not None and found.group(1) else value
    found = _SLASH.match(t)
    if found:
        denominator = float(found.group(2))
        return float(found.group(1)) / denominator if denominator else None
    if _PLAIN.match(t):
        value = float(t)
        return value if math.isfinite(value) else None
    return None


def _plain_signs(text: str) -> str:
    """LaTeX's thousands separator `{,}` (MATH writes 10{,}000) as a comma, a space between digit
    groups (`1\\,234`, U+202F) dropped, and the Unicode minus (U+2212) as "-": otherwise a reader sees
    "000", "1" or "5"."""
    return _GROUP_SPACE.sub("", text.replace("{,}", ",").replace("\u2212", "-"))


def final_number(answer: str) -> tuple[str | None, float | None]:
    """The answer's final number as written and its value: a `\\boxed{}` that holds a number, else the
    first number after the last "Answer:"/"**Answer**:"/"answer is"/"####", else the last number in
    the answer."""
    answer = _plain_signs(answer)
    boxed = last_boxed(answer)
    if boxed is not None and (value := parse_number(boxed)) is not None:
        return boxed.strip(), value
    markers = list(_MARKER.finditer(answer))
    if markers:
        tail = answer[markers[-1].end() :]
        if (spaced := _SPACED_GROUPS.match(tail.lstrip(" *_$"))) is not None:
            return spaced.group(1), float(spaced.group(1).replace(" ", ""))
        for token in _TOKEN.findall(tail):
            if (value := parse_number(token)) is not None:
                return token.strip(), value
    for token in reversed(_TOKEN.findall(answer)):
        if (value := parse_number(token)) is not None:
            return token.strip(), value
    return None, None


def grade_number(answer: str, gold: str, rel_tol: float = 1e-6) -> Grade:
    expected = parse_number(gold)
    if expected is None:
        raise ValueError(f"gold {gold!r} is not a number")
    written, value = final_number(answer or "")
    if value is None:
        return Grade(0.0, None, "no number found")
    right = math.isclose(value, expected, rel_tol=rel_tol, abs_tol=1e-9)
    return Grade(1.0 if right else 0.0, written, f"read {written}, gold {gold}")


# ---- match ------------------------------------------------------------------------------------------
def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1 between two normalised strings."""
    pred, ref = prediction.split(), reference.split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def folded_key(text: str) -> str | None:
    """router.answers.span_key without accents: "Zürich", "Zurich" and "ZURICH" are one answer, as
    are "café" and "cafe" (a worker's spelling of a name is not its knowledge of it). Letters that
    decompose (ü → u + ¨) lose their marks; others (ß, ø) stay as they are."""
    decomposed = unicodedata.normalize("NFKD", text)
    return span_key("".join(c for c in decomposed if not unicodedata.combining(c)))


def grade_match(answer: str, golds: Sequence[str], partial: str | None = "f1") -> Grade:
    """1 when an accepted answer, normalised, appears whole in the normalised answer (workers add
    words: "It was Bayreuth."); otherwise the best token F1 against an accepted answer with
    `partial="f1"` (LLMRouter's metric for these tasks), or 0. Accents are ignored on both sides
    (:func:`folded_key`)."""
    said = folded_key(answer or "")
    accepted = [key for g in golds if (key := folded_key(str(g)))]
    if not accepted:
        raise ValueError("no usable accepted answer")
    if said is None:
        return Grade(0.0, None, "empty answer")
    for key in accepted:
        if f" {key} " in f" {said} ":
            return Grade(1.0, said, f"contains {key!r}")
    if partial == "f1":
        best = max(token_f1(said, key) for key in accepted)
        return Grade(round(best, 4), said, f"token F1 {best:.2f} against {accepted[0]!r}")
    return Grade(0.0, said, f"does not contain {accepted[0]!r}")


# ---- code -------------------------------------------------------------------------------------------
def graded_source(answer: str) -> str | None:
    """The Python a code answer is graded on: its fenced Python blocks that parse, joined in order,
    when they define a function or class (an import or a helper in one block, the function in the
    next: "```python\\nimport math\\n```" then "```python\\ndef f(x): ...```"), else
    router.answers.python_source (the first block with a function, a [PYTHON] block, or the whole
    answer). The test run executes the program statement by statement, so a usage block joined in
    (a print, an input()) hides no function. Grading only: the planner's and the offline
    evaluation's readers stay router.answers.python_source."""
    blocks = [block.strip("\n") for block in FENCE.findall(answer)]
    parsed = [block for block in blocks if parse_python(block) is not None]
    if len(parsed) > 1:
        joined = "\n\n".join(parsed)
        tree = parse_python(joined)
        if tree is not None and any(isinstance(node, ast.FunctionDef | ast.ClassDef) for node in tree.body):
            return joined
    return python_source(answer)


def grade_code(
    answer: str,
    tests: Sequence[str],
    setup: str | None = None,
    *,
    timeout_s: float = CODE_TIMEOUT_S,
    per_call_s: float = CODE_PER_CALL_S,
) -> Grade:
    """Run the answer's Python, after `setup` (a stub's imports and helpers), against `tests` (single
    asserts; each calls the task's function, which is bound to the answer's main function). Blocking:
    call it from a thread in async code."""
    source = graded_source(answer or "")
    if source is None:
        return Grade(0.0, None, "no Python function found in the answer")
    program = f"{setup.rstrip()}\n\n{source}" if setup else source
    behaviour = run_behaviour([program], [], list(tests), timeout_s=timeout_s, per_call_s=per_call_s)[0]
    if behaviour is None or behaviour.assert_pass is None:
        return Grade(0.0, None, f"the test run did not finish (timeout {timeout_s:g} s or a crash)")
    passed = round(behaviour.assert_pass * len(tests))
    return Grade(
        1.0 if passed == len(tests) else 0.0,
        f"{passed}/{len(tests)}",
        f"passed {passed} of {len(tests)} tests",
    )


# ---- dispatch ---------------------------------------------------------------------------------------
def grade(probe: Probe, answer: str) -> Grade:
    """Grade `answer` to `probe` with its type's grader and the probe's parameters."""
    params = probe.grader
    if probe.type == "choice":
        return grade_choice(answer, str(probe.gold), str(params.get("letters", "ABCD")))
    if probe.type == "number":
        return grade_number(answer, str(probe.gold), float(params.get("rel_tol", 1e-6)))
    if probe.type == "match":
        golds = probe.gold if isinstance(probe.gold, list) else [str(probe.gold)]
        return grade_match(answer, golds, params.get("partial", "f1"))
    return grade_code(
        answer,
        probe.tests,
        probe.setup,
        timeout_s=float(params.get("timeout_s", CODE_TIMEOUT_S)),
        per_call_s=float(params.get("per_call_s", CODE_PER_CALL_S)),
    )
