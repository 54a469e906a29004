"""The library is the library: `import lightning_elastic` loads none of the recipes' zoo, Hydra or data sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FRESH_IMPORT = """
import json, pkgutil, sys
import lightning_elastic
print(json.dumps({
    "modules": sorted(sys.modules),
    "submodules": sorted(info.name for info in pkgutil.iter_modules(lightning_elastic.__path__)),
}))
"""


def test_importing_the_library_loads_no_zoo_and_no_hydra() -> None:
    result = subprocess.run(
        [sys.executable, "-c", FRESH_IMPORT], cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    )
    loaded = json.loads(result.stdout)
    modules = set(loaded["modules"])
    assert {name for name in modules if name.split(".")[0] in {"elastic_zoo", "hydra", "omegaconf"}} == set()
    assert {name for name in modules if name.startswith("lightning_elastic.zoo")} == set()
    # The zoo is no sub-package of the library at all (it was `lightning_elastic/zoo/`).
    assert "zoo" not in loaded["submodules"]
    assert {"callback", "selector", "profiling"} <= set(loaded["submodules"])
