#!/usr/bin/env python3
"""Assertion density of product crates: assertion macro calls per function, test code
left out (items under #[cfg(test)], files of test modules, tests/ directories).

Counts the calls of assert!, assert_eq!, assert_ne! and their debug_ forms, and the
`fn` items (methods, free and nested functions; not closures). Usage, from the
repository root:

    python3 scripts/assert-density.py [crate ...]    # default: region broker sequencer replication
"""
import re
import sys
from pathlib import Path

ASSERT = re.compile(r"\b(?:debug_)?assert(?:_eq|_ne)?!\s*[\(\[\{]")
FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
                r"(?:extern\s+\"[^\"]*\"\s+)?fn\s+\w+")
TEST_MOD_FILE = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")


# One pass, leftmost first: a quote inside a comment, or `//` or a brace inside a string or
# a char literal, is not taken for what it is outside one.
TOKEN = re.compile(r"""//[^\n]*|"(?:\\[\s\S]|[^"\\])*"|'(?:\\.|[^'\\\n])'""")


def strip_comments(text):
    """Drops comments and the contents of string and char literals, so none counts."""
    return TOKEN.sub(lambda m: "" if m.group(0).startswith("//") else '""', text)


def product_code(text):
    """`text` without the items annotated #[cfg(test)]."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "#[cfg(test)]":
            out.append(lines[i])
            i += 1
            continue
        # Skip the attribute and the item it marks: up to its closing brace, or a `;`.
        depth, opened, i = 0, False, i + 1
        while i < len(lines):
            line = lines[i]
            depth += line.count("{") - line.count("}")
            opened |= "{" in line
            i += 1
            if (opened and depth <= 0) or (not opened and line.rstrip().endswith(";")):
                break
    return "\n".join(out)


def density(crate):
    src = Path("crates") / crate / "src"
    files = sorted(src.rglob("*.rs"))
    test_files = set()
    for f in files:
        for name in TEST_MOD_FILE.findall(f.read_text()):
            test_files.add(f.parent / f"{name}.rs")
    asserts = fns = 0
    for f in files:
        if f in test_files:
            continue
        code = product_code(strip_comments(f.read_text()))
        asserts += len(ASSERT.findall(code))
        fns += sum(1 for line in code.split("\n") if FN.match(line))
    return asserts, fns


def main():
    crates = sys.argv[1:] or ["region", "broker", "sequencer", "replication"]
    total_a = total_f = 0
    print(f"{'crate':<12} {'asserts':>8} {'fns':>6} {'per fn':>7}")
    for crate in crates:
        a, f = density(crate)
        total_a, total_f = total_a + a, total_f + f
        print(f"{crate:<12} {a:>8} {f:>6} {a / f:>7.2f}")
    print(f"{'all':<12} {total_a:>8} {total_f:>6} {total_a / total_f:>7.2f}")


if __name__ == "__main__":
    main()
