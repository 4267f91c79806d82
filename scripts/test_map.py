"""Which modules of ``rl_plugin/`` have their unit tests at the mirrored path (issue 43, item 5).

The rule: ``rl_plugin/a/b/c.py`` is tested by ``tests/fast/a/b/test_c.py``; a package's
``__init__.py`` by ``tests/fast/a/b/test_b.py`` (``rl_plugin/arguments/__init__.py`` ->
``tests/fast/arguments/test_arguments.py``). Cross-cutting suites (``tests/fast/parity``,
``e2e``, ``cli``, ...) keep their own folders and are not counted.

Only modules over 40 lines count, and "lines" are plain lines as ``wc -l`` counts them (every
``\\n``, blank and comment lines included), so the number is easy to check by hand. The share is
the number of counted modules with a mirrored test file over the number of counted modules.

    python scripts/test_map.py               # every counted module, then the share
    python scripts/test_map.py --missing     # only the modules without a mirrored test
    python scripts/test_map.py loss lora     # only modules under rl_plugin/loss, rl_plugin/lora
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rl_plugin"
TESTS = ROOT / "tests" / "fast"
MIN_LINES = 40  # a module counts when it has more lines than this


@dataclass(frozen=True)
class Module:
    path: Path  # relative to the repository root
    lines: int
    test: Path  # the mirrored test file (relative to the repository root)

    @property
    def tested(self) -> bool:
        return (ROOT / self.test).is_file()


def mirrored_test(module: Path) -> Path:
    """``rl_plugin/a/b/c.py`` -> ``tests/fast/a/b/test_c.py``; ``rl_plugin/a/b/__init__.py`` ->
    ``tests/fast/a/b/test_b.py`` (``module`` relative to the repository root)."""
    rel = module.relative_to("rl_plugin")
    if rel.name == "__init__.py":
        if rel.parent == Path("."):
            return Path("tests/fast/test_rl_plugin.py")
        return Path("tests/fast") / rel.parent / f"test_{rel.parent.name}.py"
    return Path("tests/fast") / rel.parent / f"test_{rel.name}"


def modules(prefixes: list[str] | None = None) -> list[Module]:
    """Every module of ``rl_plugin`` over ``MIN_LINES`` lines, sorted by path; with ``prefixes``
    (paths below ``rl_plugin/``, e.g. ``loss`` or ``cp.py``) only those under one of them."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        inner = path.relative_to(PACKAGE).as_posix()
        if prefixes and not any(inner == p or inner.startswith(p.rstrip("/") + "/") for p in prefixes):
            continue
        lines = path.read_bytes().count(b"\n")
        if lines > MIN_LINES:
            found.append(Module(rel, lines, mirrored_test(rel)))
    return found


def share(found: list[Module]) -> tuple[int, int]:
    """(modules with a mirrored test, modules counted)."""
    return sum(m.tested for m in found), len(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="paths below rl_plugin/ to limit the listing to")
    parser.add_argument("--missing", action="store_true", help="list only modules without a mirrored test")
    opts = parser.parse_args()
    found = modules(opts.prefixes)
    for m in found:
        if opts.missing and m.tested:
            continue
        print(f"{'yes' if m.tested else ' no'}  {m.lines:4d}  {m.path}  ->  {m.test}")
    tested, total = share(found)
    pct = 100.0 * tested / total if total else 0.0
    print(f"{tested} of {total} modules over {MIN_LINES} lines have a mirrored test ({pct:.1f}%)")


if __name__ == "__main__":
    main()
