"""`scan` commands turn numpy's huge-page advice off (system time at 12,288 ranks), unless the user set it."""
from __future__ import annotations

import pytest

mam = pytest.importorskip("numpy._core.multiarray")

from megatronapp.scan import cli  # noqa: E402


@pytest.fixture
def advice():
    before = mam._get_madvise_hugepage()
    yield
    mam._set_madvise_hugepage(before)


def test_small_pages_turns_advice_off(advice, monkeypatch) -> None:
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    mam._set_madvise_hugepage(True)
    cli._small_pages()
    assert mam._get_madvise_hugepage() is False


def test_user_setting_is_kept(advice, monkeypatch) -> None:
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    mam._set_madvise_hugepage(True)
    cli._small_pages()
    assert mam._get_madvise_hugepage() is True
