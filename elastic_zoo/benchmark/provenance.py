"""Which code a benchmark measured: the folder `lightning_elastic` was imported from, its commit, uncommitted changes.

A recipe run from one checkout imports the library from wherever Python finds it first: with the editable install of
`make`, that is the checkout the virtual environment was installed from, not necessarily the one the recipe (and its
`conf/`) came from. A benchmark run from a git worktree of an older commit would then measure the newer code, and
every spawned run with it (they inherit the parent's `sys.path`). The report names the code it measured, and the
benchmark warns before its first run when that code is not the recipe's checkout.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import lightning_elastic

# The packages whose code a benchmark's figures depend on (the recipes' zoo included).
MEASURED = ("lightning_elastic", "elastic_zoo")


@dataclass(frozen=True)
class CodeProvenance:
    """Where the measured code came from.

    Attributes:
        library: the folder the `lightning_elastic` package was imported from.
        commit: the commit of the git checkout holding it; empty when it is not in one (an installed copy).
        dirty: whether the measured packages had uncommitted changes in that checkout.
    """

    library: Path
    commit: str
    dirty: bool

    def line(self) -> str:
        """One line for the report's header.

        Example:
            >>> CodeProvenance(Path("/src/lightning_elastic"), "2636ce9" + "0" * 33, dirty=True).line()
            'code: lightning_elastic from /src/lightning_elastic, commit 2636ce90000 with uncommitted changes'
        """
        if not self.commit:
            return f"code: lightning_elastic from {self.library} (not in a git checkout)"
        changes = " with uncommitted changes" if self.dirty else ""
        return f"code: lightning_elastic from {self.library}, commit {self.commit[:11]}{changes}"

    def mismatch(self, checkout: Path) -> str | None:
        """A warning when the measured library is not the one in `checkout` (the recipe's own); None when it is.

        Example:
            >>> CodeProvenance(Path("/a/lightning_elastic"), "", False).mismatch(Path("/b"))[:57]
            'benchmark: the library measured is /a/lightning_elastic, '
        """
        own = checkout.resolve() / "lightning_elastic"
        if self.library.resolve() == own:
            return None
        return (
            f"benchmark: the library measured is {self.library}, not this checkout's {own}: the figures are that "
            f"code's. To measure this checkout, run with PYTHONPATH={checkout.resolve()}"
        )


def code_provenance(library: Path | None = None) -> CodeProvenance:
    """The `CodeProvenance` of a `lightning_elastic` folder; by default, the one this process imported."""
    library = (library or Path(lightning_elastic.__file__).parent).resolve()
    checkout = library.parent  # the folder holding the package, where git is asked
    tracked = _git(checkout, "ls-files", "--", "lightning_elastic/__init__.py")  # not an ignored copy
    commit = _git(checkout, "rev-parse", "HEAD") if tracked else ""
    if not commit:
        return CodeProvenance(library, "", dirty=False)
    changes = _git(checkout, "status", "--porcelain", "--untracked-files=no", "--", *MEASURED)
    return CodeProvenance(library, commit, dirty=bool(changes))


def _git(folder: Path, *args: str) -> str:
    """`git -C folder args` printed output, stripped; empty when git is missing or the folder is no checkout."""
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
