"""The package's prose, read from the source with ``tokenize`` (nothing is imported): no case id
(``C0``..``C99``) or issue number in any comment or string of ``moe_async/``, since neither is
defined in the repository; the fault a line guards is said in words."""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moe_async"
CASE_ID = re.compile(r"\bC\d{1,2}\b|\bissue \d+", re.IGNORECASE)
# matplotlib's colour-cycle names ("C0".."C9") are a string's whole value, never prose
COLOUR = re.compile(r"""^[rbuRBU]*(['"])C\d\1$""")
# Python 3.12 splits an f-string into parts; its text parts are FSTRING_MIDDLE tokens
PROSE = {tokenize.COMMENT, tokenize.STRING} | (
    {tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())


def case_ids(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment or string token of ``source`` naming a case id or an issue
    number. A string that is exactly a matplotlib colour-cycle name (``"C3"``) is not prose."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in PROSE:
            continue
        if tok.type == tokenize.STRING and COLOUR.match(tok.string):
            continue
        for m in CASE_ID.finditer(tok.string):
            found.append((tok.start[0] + tok.string[: m.start()].count("\n"), m.group(0)))
    return found


def test_finder_finds_planted_case_ids():
    src = ('"""Doc (case C14) and\nissue 19 here."""\n'
           'x = 1  # guard (C2)\n'
           'color = "C9"\n'
           'label = f"see C7"\n'
           'name = "CC12 or C123 or Cx"\n')
    assert case_ids(src) == [(1, "C14"), (2, "issue 19"), (3, "C2"), (5, "C7")]


def test_no_case_ids_or_issue_numbers_in_the_package():
    hits = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in sorted(PKG.rglob("*.py"))
            for line, text in case_ids(p.read_text())]
    assert hits == [], "case ids / issue numbers in moe_async (say the fault in words):\n" + "\n".join(hits)


MAX_DOCSTRING_LINES = 18


def test_module_docstrings_are_short():
    """A module docstring says what the module is for and its contract in a few lines; design
    notes live in docs/design/ (the documentation site)."""
    import ast

    long = {}
    for p in sorted(PKG.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        if doc and (n := doc.count("\n") + 1) > MAX_DOCSTRING_LINES:
            long[str(p.relative_to(ROOT))] = n
    assert long == {}, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the design prose to docs/design/): {long}"
