"""kernels/ shares its top-level name with Hugging Face's `kernels` package, which transformers imports when it is
installed: a name only that package has gets an error that says so."""

from __future__ import annotations

import pytest

import kernels


def test_a_hugging_face_kernels_name_says_which_package_shadows_it():
    with pytest.raises(ImportError, match=r"shadows Hugging Face's `kernels` package.*transformers < 5\.25"):
        from kernels import CUDAProperties  # noqa: F401  (what transformers >= 5.25 imports first)


def test_own_modules_and_dunders_resolve_as_usual():
    from kernels import pdl  # a module of ours, possibly not imported yet

    assert pdl.__name__ == "kernels.pdl"
    assert getattr(kernels, "__version__", None) is None
    with pytest.raises(AttributeError):
        kernels.__wrapped__  # noqa: B018  (introspection tools probe dunders and must see AttributeError)
