#!/usr/bin/env python3
"""Functions longer than a limit in the product crates (issue 23: none over 100 lines),
test code left out as `assert-density.py` leaves it out (whose parsing this reuses).

A function runs from its `fn` line to the line where its braces close, blank and comment
lines included. Usage, from the repository root:

    python3 scripts/fn-length.py [LIMIT] [crate ...]   # default: 100, every crate in crates/

scripts/test.sh runs it with 70, the style rule (every function has been under it
since session 29).

Prints the longest first and exits 1 if any is over LIMIT.
"""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "assert_density", Path(__file__).with_name("assert-density.py"))
density = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(density)


def functions(path):
    """(name, first line, length) of each function in the product code of one file."""
    lines = density.product_code(density.strip_comments(path.read_text())).split("\n")
    out = []
    for start, line in enumerate(lines):
        if not density.FN.match(line):
            continue
        depth, opened, end = 0, False, start
        for end in range(start, len(lines)):
            depth += lines[end].count("{") - lines[end].count("}")
            opened |= "{" in lines[end]
            if (opened and depth <= 0) or (not opened and lines[end].rstrip().endswith(";")):
                break
        name = line.split("fn ", 1)[1].split("(")[0].split("<")[0].strip()
        out.append((name, start + 1, end - start + 1))
    return out


def main():
    args = sys.argv[1:]
    limit = int(args.pop(0)) if args and args[0].isdigit() else 100
    crates = args or sorted(p.name for p in Path("crates").iterdir() if (p / "src").is_dir())
    found = []
    for crate in crates:
        src = Path("crates") / crate / "src"
        files = sorted(src.rglob("*.rs"))
        tests = {f.parent / f"{m}.rs" for f in files for m in density.TEST_MOD_FILE.findall(f.read_text())}
        for f in files:
            if f not in tests:
                found += [(name, f, first, length) for (name, first, length) in functions(f)]
    found.sort(key=lambda x: -x[3])
    for name, f, first, length in found[:10]:
        print(f"{length:>5}  {f}:{first}  {name}")
    over = [x for x in found if x[3] > limit]
    print(f"{len(found)} functions; {len(over)} over {limit} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
