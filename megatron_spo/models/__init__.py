"""megatron-core decoder models of several HF families, the HF<->Megatron map and checkpoint conversion.

Modules (import them directly; nothing here imports megatron, so `import megatron_spo.models` is free):
  cpu_shims            apply_cpu_shims(): every CPU workaround for megatron-core, only when no CUDA
  parallel             init_parallel(parallel_cfg, model_cfg, seed=) / destroy_parallel() / spawn_local()
  arch/                the architecture registry: one module per family (llama, qwen2, qwen3, mistral) with
                       its config.json reading/writing, megatron feature knobs and HF<->Megatron rule table
  spec                 layer_spec(model_cfg): Transformer Engine spec when usable, local spec otherwise
  builders             build_policy / build_reference / build_value_model -> list of model chunks;
                       output_hidden_states(chunks), gpt_hidden_states(model, ids), lm_head_weight(model)
  pipeline             run_pipeline(chunks, ids, loss_fn=...), gather_logits_to_rank0(chunks, ids, vocab)
  hf_map               THE name/layout map; load_hf_into_model(chunks, cfg, get_tensor),
                       iter_hf_tensors(chunks, cfg) -> (hf_name, full tensor) on rank 0 (live weight sync)
  hf_checkpoint        read/write HF dirs (config.json <-> ModelConfig, sharded safetensors + index)
  megatron_checkpoint  save_megatron / load_megatron (dist_checkpointing, any TP/PP), read_megatron_config
  convert              `megatron-spo convert ...` and `megatron-spo check-conversion ...`
"""
