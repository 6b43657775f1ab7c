"""SGLang adapter: `--radix-cache-backend linearkv` at start-up (the scheduler's cache factory,
the server's config read once, the chunk namespace, chunk registrations kept out of KV events)."""

from __future__ import annotations

import functools
from typing import Any

from sglang.srt.mem_cache.unified_cache.components import ComponentType

from sglang_ext.linearkv.mamba_component import LinearKVMambaComponent
from sglang_ext.linearkv.model_layers import KeyRelocator, attention_layers, check_rotary, scalar_decays_only
from sglang_ext.linearkv.serving import COMPOSING_RULES, LinearKVConfig, check_server_flags, is_chunk_namespace
from sglang_ext.linearkv.sglang_cache import LinearKVRadixCache
from sglang_ext.linearkv.transitions import ChunkTransitions


@functools.lru_cache(maxsize=1)
def server_linearkv_config() -> LinearKVConfig:
    from sglang_ext.env import linearkv_config_text
    from sglang_ext.linearkv.serving import parse_config

    return parse_config(linearkv_config_text())


def linearkv_cache_factory(ctx: Any) -> Any:
    """`--radix-cache-backend linearkv`: SGLang calls this once per scheduler at start-up."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from sglang_ext.tail_replay import check_scheduler_start, server_config

    config = server_linearkv_config()
    tail_config = server_config()
    check_scheduler_start(ctx, tail_config)
    if not ctx.is_hybrid_ssm:
        raise ValueError("--radix-cache-backend linearkv needs a hybrid model with linear-attention "
                         "or SSM layers (GDN, Mamba-2); this model has none")
    check_server_flags(ctx.server_args)
    model = ctx.tp_worker.model_runner.model
    layers = attention_layers(model)
    check_rotary(layers)
    can_compose = scalar_decays_only(model)
    if config.state in COMPOSING_RULES and not can_compose:
        raise ValueError(f"--linearkv-config key 'state': {config.state!r} is served for Mamba-2 models only "
                         "(this model has GDN layers, whose chunk transition is a matrix per head)")
    ctx.params.component_registry_override = {
        **(ctx.params.component_registry_override or {}),
        ComponentType.MAMBA: LinearKVMambaComponent,
    }
    cache_class = type("LinearKVRadixCache", (LinearKVRadixCache,), {
        "tail_replay_config": tail_config, "linearkv_config": config,
        "chunk_namespace": chunk_namespace(ctx.server_args), "can_compose": can_compose})
    cache = create_unified_radix_cache(ctx, cache_class=cache_class)
    cache.transitions = ChunkTransitions()
    allocator = cache.token_to_kv_pool_allocator
    cache.relocator = KeyRelocator(allocator.get_kvcache(), layers,
                                   translate=getattr(allocator, "translate_kv_loc", None))   # a unified pool's
    hide_chunk_events(cache.tree_core.kv_events)
    return cache


def hide_chunk_events(recorder: Any) -> None:
    """Leave chunk registrations out of SGLang's KV events (`--kv-events-config`): a chunk's KV
    sits at offset 0 of a namespace no prompt matches, so a router that took it for a prompt
    prefix would route by a false affinity. Stores and removals of every other node pass."""
    store, remove = recorder.record_store, recorder.record_remove

    @functools.wraps(store)
    def record_store(node: Any, *args: Any, **kwargs: Any) -> None:
        if not is_chunk_namespace(node.key.extra_key):
            store(node, *args, **kwargs)

    @functools.wraps(remove)
    def record_remove(node: Any, *args: Any, **kwargs: Any) -> None:
        if not is_chunk_namespace(node.key.extra_key):
            remove(node, *args, **kwargs)

    recorder.record_store, recorder.record_remove = record_store, record_remove


def chunk_namespace(server_args: Any) -> str:
    from sglang_ext.linearkv.serving import namespace

    return namespace(str(getattr(server_args, "served_model_name", None) or server_args.model_path))
