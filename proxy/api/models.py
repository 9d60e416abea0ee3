"""What is served: /v1/models and the template self-test's verdict (/v1/template), also per session."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from proxy.api.deps import StateDep
from proxy.api.json_route import OrjsonRoute

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OrjsonRoute)


@router.get("/template")
async def template_report(state: StateDep) -> dict[str, Any]:
    """The start-up self-test's verdict on the served chat template, the tool parser chosen, and what
    the engine reports (for vLLM: its logprobs mode and whether its logprobs are the sampled
    distribution)."""
    parser = state.tool_parser.as_json() if state.tool_parser is not None else None
    report = getattr(state.engine, "report", None)
    engine = report() if callable(report) else {"kind": state.engine.name}
    # The encode cache's report is read now: its tiktoken proof is made after start-up.
    encode_cache = state.renderer.pieces.as_json()
    return {
        **state.renderer.verdict.as_json(),
        "encode_cache": encode_cache,
        "tool_parser": parser,
        "engine": engine,
    }


@router.get("/models")
async def list_models(state: StateDep) -> dict[str, Any]:
    """The served model, then the LoRA adapters the engine serves now, each with `parent` (the served
    model) and `root` (where the engine loaded it from), as SGLang and vLLM list them."""
    adapters = await state.model_names.adapters(older_than=0.0)
    base = {
        "id": state.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "tito-proxy",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.context_length,
    }
    cards = [
        {**base, "id": name, "root": root, "parent": state.model_name} for name, root in adapters.items()
    ]
    return {"object": "list", "data": [base, *cards]}
