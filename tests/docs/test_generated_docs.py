"""docs/phases.md and docs/error-codes.md always match the code they are generated from."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from orchestrator.errors import ErrorCode
from orchestrator.models import Phase

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gen_docs.py"


def _gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestGeneratedDocs:
    """The generated documents are fresh; regenerate with `python scripts/gen_docs.py`."""

    def test_phases_and_error_codes_docs_are_not_stale(self) -> None:
        stale = _gen_docs().stale()
        assert stale == [], f"stale generated docs: {stale}; run python scripts/gen_docs.py"

    def test_every_phase_and_code_appears_in_the_docs(self) -> None:
        gen = _gen_docs()
        phases_md, codes_md = gen.render_phases(), gen.render_error_codes()
        assert all(f"`{p.value}`" in phases_md for p in Phase)
        assert all(f"`{c.value}`" in codes_md for c in ErrorCode)

    def test_a_changed_table_makes_the_docs_stale(self, tmp_path: Path) -> None:
        gen = _gen_docs()
        copy = tmp_path / "phases.md"
        edited = gen.render_phases().replace("`PARKED` | `retry_requested`", "`PARKED` | `x`")
        copy.write_text(edited)
        gen.GENERATED = {copy: gen.render_phases}
        assert gen.stale() == [copy]
