"""transformers' own model test mixins (`ModelTesterMixin` from `tests/test_modeling_common.py`), to run against
ResFormer as transformers runs them against Llama.

transformers does not ship its tests in the wheel; the 5.23.0 source distribution on PyPI has the top-level
`tests/*.py` (Apache-2.0), but not the subpackages `test_modeling_common.py` imports (`generation/test_utils.py`,
`exporters/test_export.py`). The sdist is fetched once with pip into the test cache (`pypi_cache`), its `tests/*.py`
are unpacked as the package `transformers_tests`, and the two missing modules are stood in for by empty mixins: the
generation and export tests they would add are not in the sdist, so they cannot run here (this repository's own
generation and export tests cover those paths).
"""

from __future__ import annotations

import importlib
import sys
import tarfile
from pathlib import Path

import transformers

from pypi_cache import cached, pip_sdist

PACKAGE = "transformers_tests"
#: Modules `test_modeling_common.py` imports that the sdist lacks, and what stands in for each.
MISSING_MODULES = {
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
}


def _unpack(sdist_dir: Path, target: Path) -> None:
    (archive,) = sdist_dir.glob("transformers-*.tar.gz")
    package = target / PACKAGE
    package.mkdir()
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                (package / parts[2]).write_bytes(tar.extractfile(member).read())
    (package / "__init__.py").touch()
    for relative, source in MISSING_MODULES.items():
        path = package / relative
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(f'"""Stand-in: this module is not in the transformers sdist."""\n\n{source}')


def load_modeling_common():
    """transformers' `tests/test_modeling_common.py` for the installed version, as a module.

    Raises `pypi_cache.FetchError` when the sdist cannot be fetched (offline)."""
    version = transformers.__version__
    sdist = pip_sdist(f"transformers-{version}-sdist", f"transformers=={version}")
    root = cached(f"transformers-{version}-tests", lambda target: _unpack(sdist, target))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")


__all__ = ["MISSING_MODULES", "PACKAGE", "load_modeling_common"]
