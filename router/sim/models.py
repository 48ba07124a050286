"""Which models a sim serves, and how it says so: vLLM's ``--served-model-name``.

vLLM answers only for the names it was started with (``--served-model-name NAME...``; without
it, the model's path). A request naming any other model gets vLLM's 404 body, and every
response names the *first* served name whatever alias the request used, as vLLM's
``OpenAIServingModels.model_name`` does. ``GET /v1/models`` lists every name as a vLLM
``ModelCard`` (``owned_by: "vllm"``, ``root`` the model path, ``max_model_len``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

__all__ = ["ModelCard", "ModelList", "ModelPermission", "ServedModels"]


class ModelPermission(msgspec.Struct, kw_only=True):
    """vLLM's ``ModelPermission`` (one per card; OpenAI dropped the field, vLLM still sends it)."""

    id: str
    object: str = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of ``GET /v1/models``, as vLLM's ``ModelCard``."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = msgspec.field(default_factory=list)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ServedModels:
    """The names a sim answers to; the first is the one its responses carry."""

    def __init__(self, names: Sequence[str], *, root: str, max_model_len: int) -> None:
        if not names:
            raise ValueError("a sim serves at least one model name")
        if any(not name for name in names):
            raise ValueError("a served model name cannot be empty")
        self.names: tuple[str, ...] = tuple(dict.fromkeys(names))
        self.root = root
        self.max_model_len = max_model_len
        self._known = frozenset(self.names)
        created = int(time.time())
        cards = [
            ModelCard(
                id=name,
                created=created,
                root=root,
                max_model_len=max_model_len,
                permission=[ModelPermission(id=f"modelperm-sim-{i}", created=created)],
            )
            for i, name in enumerate(self.names)
        ]
        self.list_body: bytes = msgspec.json.encode(ModelList(data=cards))
        """The ``GET /v1/models`` body, encoded once."""

    @property
    def name(self) -> str:
        """The name responses carry (vLLM's first served name)."""
        return self.names[0]

    def serves(self, model: str | None) -> bool:
        """True when a request for ``model`` is answered (vLLM: a missing model means the
        default one)."""
        return not model or model in self._known

    @staticmethod
    def not_found_body(model: str) -> bytes:
        """vLLM's 404 body for a model it does not serve (``OpenAIServing._check_model``)."""
        return msgspec.json.encode(
            {
                "error": {
                    "message": f"The model `{model}` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            }
        )
