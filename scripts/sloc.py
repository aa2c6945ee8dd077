"""Source lines of code under a folder: lines that hold code, not blank, comment or docstring
lines (what `cloc` calls code).

    python scripts/sloc.py server
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

_SKIPPED = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_lines(text: str) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, _DOCUMENTED) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def source_lines(text: str) -> int:
    docs = docstring_lines(text)
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in _SKIPPED:
            code.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docs)
    return len(code)


if __name__ == "__main__":
    print(sum(source_lines(p.read_text()) for p in sorted(Path(sys.argv[1]).rglob("*.py"))))
