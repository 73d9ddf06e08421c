#!/usr/bin/env python3
"""Assertion density of product crates: assertion macro calls per function, test code
left out (items under #[cfg(test)], files of test modules, tests/ directories).

Counts the calls of assert!, assert_eq!, assert_ne! and their debug_ forms, and the
`fn` items with a body (methods, free and nested functions; not closures, not a trait's
bodiless declarations). Code only for tests of other crates (`#[cfg(feature =
"test-support")]`) is left out like test code. Compile-time assertions (`const _: () =
assert!(...)`, layout facts) are counted, and shown apart in the `static` column, so the
runtime checks per function can be read too. Usage, from the repository root:

    python3 scripts/assert-density.py [crate ...]    # default: region broker sequencer replication
"""
import re
import sys
from pathlib import Path

ASSERT = re.compile(r"\b(?:debug_)?assert(?:_eq|_ne)?!\s*[\(\[\{]")
STATIC_ASSERT = re.compile(r"\bconst\s+_\s*:\s*\(\)\s*=\s*assert!")
FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
                r"(?:extern\s+\"[^\"]*\"\s+)?fn\s+\w+")
TEST_MOD_FILE = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")


# One pass, leftmost first: a quote inside a comment, or `//` or a brace inside a string or
# a char literal, is not taken for what it is outside one.
TOKEN = re.compile(r"""//[^\n]*|"(?:\\[\s\S]|[^"\\])*"|'(?:\\.|[^'\\\n])'""")


def strip_comments(text):
    """Drops comments and the contents of string and char literals, so none counts."""
    return TOKEN.sub(lambda m: "" if m.group(0).startswith("//") else '""', text)


TEST_ONLY = {"#[cfg(test)]", '#[cfg(feature = "test-support")]'}


def product_code(text):
    """`text` without the items annotated #[cfg(test)] (or only built for other crates'
    tests)."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() not in TEST_ONLY:
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


def has_body(code, start):
    """Whether the `fn` item whose signature starts at `start` has a body: its first `{`
    or `;` outside brackets (an array type `[u8; 4]` holds a `;`) is a `{`."""
    depth = 0
    for ch in code[start:]:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0 and ch in "{;":
            return ch == "{"
    return False


def count_fns(code):
    lines = code.split("\n")
    offsets, at = [], 0
    for line in lines:
        offsets.append(at)
        at += len(line) + 1
    return sum(1 for line, off in zip(lines, offsets) if FN.match(line) and has_body(code, off))


def density(crate):
    src = Path("crates") / crate / "src"
    files = sorted(src.rglob("*.rs"))
    test_files = set()
    for f in files:
        for name in TEST_MOD_FILE.findall(f.read_text()):
            test_files.add(f.parent / f"{name}.rs")
    asserts = static = fns = 0
    for f in files:
        if f in test_files:
            continue
        code = product_code(strip_comments(f.read_text()))
        asserts += len(ASSERT.findall(code))
        static += len(STATIC_ASSERT.findall(code))
        fns += count_fns(code)
    return asserts, static, fns


def main():
    crates = sys.argv[1:] or ["region", "broker", "sequencer", "replication"]
    total_a = total_s = total_f = 0
    print(f"{'crate':<12} {'asserts':>8} {'static':>7} {'fns':>6} {'per fn':>7} {'runtime':>8}")

    def row(name, a, s, f):
        print(f"{name:<12} {a:>8} {s:>7} {f:>6} {a / f:>7.2f} {(a - s) / f:>8.2f}")

    for crate in crates:
        a, s, f = density(crate)
        total_a, total_s, total_f = total_a + a, total_s + s, total_f + f
        row(crate, a, s, f)
    row("all", total_a, total_s, total_f)


if __name__ == "__main__":
    main()
