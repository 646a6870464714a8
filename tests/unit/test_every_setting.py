"""Every train arg and every setting either does something a test shows, or is refused with a 400 naming it.

The fields are read from the pydantic models at test time, so a field added later fails here until it gets a
REFUSAL case (run inline below) or EVIDENCE: the node ids of tests that show its effect on what users see (a loss
curve, a file, a status, an answer, a flag passed to vLLM). This file only checks that each cited test still exists
(its file defines that function), so the evidence cannot silently rot; it never runs them. Fields that neither
do something a test shows nor are refused are listed in KNOWN_GAPS with the reason, so the gap stays visible.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from scalarlm.config import Settings, TrainingSettings
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import TrainArgs
from scalarlm.server.jobs import parse_train_args

REPO = Path(__file__).resolve().parents[2]
ROOTS: dict[str, type[BaseModel]] = {"TrainArgs": TrainArgs, "Settings": Settings}

# Train args refused with a 400 naming them (through the control plane's `parse_train_args`): the value sent and
# the text the message must contain.
REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "TrainArgs.trust_remote_code": ({"trust_remote_code": True}, "trust_remote_code"),
    "TrainArgs.distribution_strategy": ({"distribution_strategy": "fsdp"}, "distribution_strategy"),
    "TrainArgs.dtype": ({"dtype": "float16"}, "dtype"),
    "TrainArgs.training_mode": ({"training_mode": "embedding"}, "training_mode"),  # only "language_model" exists
}
# More refusals of fields that also have evidence (values of theirs the trainer does not run).
MORE_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"distribution_strategy": "ddp", "tensor_parallel_size": 2, "cpu_ranks": 2}, "distribution_strategy 'ddp'"),
    ({"dtype": "bfloat16", "gpus": 0}, "dtype 'bfloat16'"),
    ({"adapter_type": "tokenformer"}, "adapter_type"),
    ({"tensor_parallel_size": 2, "cpu_ranks": 3}, "tensor_parallel_size"),
    ({"max_token_block_size": 16, "max_seq_len": 32}, "max_token_block_size"),  # one length under two names
    ({"loss": "sft", "kl_coef": 0.1}, "kl_coef is a GRPO setting"),
    ({"loss": "grpo", "pack": False}, "pack: false is an SFT setting"),
    ({"loss": "dapo", "max_completion_length": 64}, "max_completion_length is dr_grpo's normaliser"),
    ({"loss": "sft", "clip_eps_high": 0.28}, "clip_eps_high is a GRPO setting"),
    ({"loss": "sft", "scale_rewards": "batch"}, "scale_rewards is a GRPO setting"),
    ({"loss": "sft", "importance_sampling_level": "sequence"}, "importance_sampling_level is a GRPO setting"),
    ({"loss": "sft", "mask_truncated_completions": True}, "mask_truncated_completions is a GRPO setting"),
    ({"loss": "cispo"}, "caps its importance weight at clip_eps_high"),
    ({"loss": "grpo", "sapo_temperature_pos": 2.0}, "read by loss 'sapo' only"),
    ({"loss": "grpo", "vllm_importance_sampling_mode": "token_mask"}, "vllm_importance_sampling_correction: true"),
    ({"loss": "sft", "vllm_importance_sampling_correction": True}, "vllm_importance_sampling_correction is a GRPO"),
    ({"loss": "cispo", "clip_eps_high": 5.0, "delta": 1.5}, "delta caps the clipped ratio"),
    ({"loss": "sft", "off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold is a GRPO setting"),
    ({"loss": "grpo", "use_bias_correction_kl": True}, "kl_coef is 0"),
]
REAL_POLICY_JOB = ("tests/integration/training/test_grpo_job.py::"
                   "test_a_real_jobs_first_loss_is_each_policy_objective")
SAMPLER_CORRECTION = [  # TRL's vllm_importance_sampling_*: NumPy per mode and bounds, packed = padded, a real job
    "tests/unit/training/test_grpo.py::test_sampler_correction_weighs_each_token_as_trls_vllm_importance_sampling",
    "tests/unit/training/test_grpo.py::test_sequence_level_packed_gives_the_padded_loss_and_gradients",
    REAL_POLICY_JOB,
]
SAPO = ["tests/unit/training/test_grpo.py::test_cispo_and_sapo_objectives_and_gradients_match_numpy", REAL_POLICY_JOB]

ENGINE_FLAGS = "tests/unit/inference/test_engine_settings_flags.py::test_engine_settings_are_the_engine_args_vllm_reads"
SFT_JOB = "tests/integration/training/test_sft_jobs.py::test_sft_memorises_and_publishes_hf_checkpoint"
LORA_JOB = "tests/integration/training/test_lora.py::test_lora_sft_memorises_and_publishes_a_peft_adapter"
GRPO_JOB = "tests/integration/training/test_grpo_job.py::test_grpo_lora_job_prefers_rewarded_completions"
SCHEDULE = "tests/unit/training/test_schedule.py::test_warmup_then_decay"
SBATCH_GPU = "tests/unit/launcher/test_sbatch_script.py::test_gpu_job_asks_for_gpus_per_node_on_every_node"
RESOURCES = ("tests/integration/training_api/test_train_routes.py::"
             "test_resources_a_job_leaves_out_come_from_the_training_settings")
TIME_LIMIT = "tests/integration/training_api/test_train_routes.py::test_time_limit_is_the_job_timeout_capped_by_max_train_seconds"
SPLIT_MODE = "tests/integration/inference/test_split_mode.py::test_batch_and_openai_through_split_mode"
STOP_RESUME = "tests/unit/launcher/test_stop_and_resume.py"
ARG_EFFECTS = "tests/integration/training/test_train_arg_effects.py"
PARSERS = ("tests/unit/inference/test_engine_settings_flags.py::"
           "test_tool_call_and_reasoning_parsers_reach_vllm_and_unknown_ones_are_refused")
PULL_BACKOFF = "tests/unit/inference/test_pull_backoff.py"
GENERATE = "tests/unit/server/test_generate_settings.py"

# Field -> tests that show its effect. A comment says what each shows where the test name does not.
EVIDENCE: dict[str, list[str]] = {
    # ---- train args ----
    "TrainArgs.llm_name": [  # the job trains and publishes the named (hub-cached) model
        "tests/integration/training/test_real_checkpoints.py::test_a_cached_hub_id_trains_and_publishes_a_real_checkpoint",
        "tests/integration/training/test_real_checkpoints.py::test_an_uncached_hub_id_is_a_400_naming_it_and_nothing_is_written",
    ],
    "TrainArgs.max_steps": [SFT_JOB],  # status.step, metrics rows and the last checkpoint are max_steps
    "TrainArgs.learning_rate": [SCHEDULE],  # the peak of the lr the loop steps with
    "TrainArgs.batch_size": [
        GRPO_JOB,  # batch_size 3 = three whole groups (9 rows) per step, in the metrics
        "tests/unit/training/test_data.py::test_dp_ranks_split_the_global_batch_and_share_its_token_count",
    ],
    "TrainArgs.gradient_accumulation_steps": [
        # slow: batch 1 x accum 2 x DP 2 gives the loss curve of batch 4 on one rank
        "tests/integration/training/test_sft_jobs.py::test_dp2_under_mpirun_matches_one_rank",
        "tests/unit/training/test_data.py::test_dp_ranks_split_the_global_batch_and_share_its_token_count",
    ],
    "TrainArgs.gradient_checkpointing": [
        "tests/integration/training/test_sft_jobs.py::test_gradient_checkpointing_recomputes_activations_with_the_same_gradients",
        "tests/integration/training/test_sft_jobs.py::test_gradient_checkpointing_job_reproduces_the_loss_curve",
    ],
    "TrainArgs.warmup_steps": [SCHEDULE],
    "TrainArgs.steps_per_checkpoint": [
        SFT_JOB,  # manifests at steps 10, 20, ... with steps_per_checkpoint=10
        # with steps_per_publish set, resume state is saved at steps_per_checkpoint only
        f"{ARG_EFFECTS}::test_checkpoints_are_published_every_steps_per_publish_and_state_saved_every_steps_per_checkpoint",
    ],
    "TrainArgs.steps_per_publish": [  # the job's checkpoints list is 2, 4, 5 with steps_per_publish 2, max_steps 5
        f"{ARG_EFFECTS}::test_checkpoints_are_published_every_steps_per_publish_and_state_saved_every_steps_per_checkpoint",
    ],
    "TrainArgs.max_completion_length": [  # a dr_grpo job's first loss and gradient scale by longest / 64
        "tests/integration/training/test_grpo_job.py::test_dr_grpo_divides_by_max_completion_length",
    ],
    "TrainArgs.max_token_block_size": [f"{ARG_EFFECTS}::test_max_token_block_size_is_the_block_length"],
    "TrainArgs.max_checkpoints_to_keep": [  # a job's checkpoints are 4, 5 of 2, 4, 5; staged landings prune too
        f"{ARG_EFFECTS}::test_max_checkpoints_to_keep_leaves_the_newest_published_steps",
        "tests/unit/checkpoint/test_staging.py::test_landings_keep_the_newest_max_checkpoints_to_keep_steps",
    ],
    "TrainArgs.gpus": [
        SBATCH_GPU,  # --gres=gpu:N and one task per GPU
        "tests/integration/training_api/test_train_routes.py::test_an_embedded_nodes_gpu_job_gets_the_trainers_share_of_each_gpu",
    ],
    "TrainArgs.nodes": [SBATCH_GPU],  # --nodes in the sbatch script
    "TrainArgs.adapter_type": [SFT_JOB, LORA_JOB],  # "full": an HF checkpoint; "lora": a PEFT adapter only
    "TrainArgs.lora_config.r": [LORA_JOB],  # adapter_config.json r / lora_alpha
    "TrainArgs.lora_config.alpha": [LORA_JOB],
    "TrainArgs.lora_config.dropout": [
        f"{ARG_EFFECTS}::test_lora_dropout_changes_training_after_the_first_step_and_is_in_the_adapter_config",
    ],
    "TrainArgs.lora_config.target_modules": [
        LORA_JOB,
        "tests/integration/training_api/test_model_refusals.py::test_lora_targets_and_tensor_parallel_are_checked_for_the_family",
    ],
    "TrainArgs.timeout": [
        "tests/integration/training_api/test_real_training.py::test_time_limit_saves_state_and_fails_the_job_saying_so",
        TIME_LIMIT,
        "tests/unit/launcher/test_sbatch_script.py::test_time_limit_is_capped_by_the_server_setting",
    ],
    "TrainArgs.seed": [  # loop.py hands args.seed to the block stream (and torch.manual_seed in job.py)
        "tests/unit/training/test_data.py::test_block_stream_is_seeded_reshuffles_each_epoch_and_resumes_exactly",
    ],
    "TrainArgs.tensor_parallel_size": [
        SBATCH_GPU,  # "8 ranks, tensor_parallel_size=2, data_parallel_size=4"
        RESOURCES,  # a GPU cluster gives a job one GPU per tensor-parallel rank
        "tests/unit/launcher/test_sbatch_script.py::test_tensor_parallel_group_must_fit_in_a_node",
    ],
    "TrainArgs.expert_parallel_size": [  # EP=2 trains like one rank / DP=2 (SFT, GRPO, sessions); bad sizes are 400s
        "tests/integration/training/test_moe_parity.py::test_two_rank_moe_sft_matches_one_rank_and_publishes_the_same_weights",
        "tests/integration/training/test_moe_parity.py::test_grpo_at_ep2_trains_as_dp2_with_uneven_ranks_aux_loss_and_routing_replay",
        "tests/integration/training/test_moe_parity.py::test_an_rl_session_at_ep2_steps_with_uneven_ranks_and_refuses_tinker_ops",
        "tests/integration/training/test_moe_parity.py::test_a_grpo_job_at_ep2_saved_inside_a_batch_resumes_there",
        "tests/unit/training/test_moe_family.py::test_an_expert_parallel_size_the_model_cannot_take_is_refused_at_submission",
    ],
    "TrainArgs.moe_aux_loss_coef": [  # metric = NumPy, gradient = the objective, EP=2 = DP=2; dense models: 400
        "tests/integration/training/test_moe_parity.py::test_load_balancing_loss_equals_numpy_and_its_gradient_the_written_out_objective",
        "tests/integration/training/test_moe_parity.py::test_aux_loss_trains_the_same_at_ep2_as_at_dp2_and_is_reported",
        "tests/unit/training/test_moe_family.py::test_moe_settings_the_trainer_cannot_honour_are_refused_at_submission",
    ],
    "TrainArgs.num_iterations": [  # steps per batch; later steps compare with the first; sessions: 400
        "tests/unit/training/test_grpo.py::test_a_later_step_of_a_batch_compares_rows_without_sampling_logprobs_with_the_first_step",
        "tests/integration/training/test_moe_parity.py::test_grpo_steps_over_one_batch_record_compare_and_replay_the_routing",
        "tests/unit/training/test_moe_family.py::test_grpo_iteration_and_routing_replay_settings_that_cannot_work_are_refused",
        "tests/integration/loop/test_session_routes.py::test_bad_rows_are_400_and_a_dead_trainer_fails_the_step_fast",
    ],
    "TrainArgs.routing_replay": [  # replayed layers = float64 on the recorded experts; on/off runs; refusals
        "tests/integration/training/test_moe_parity.py::test_routing_replay_runs_each_moe_layer_on_the_recorded_experts",
        "tests/integration/training/test_moe_parity.py::test_grpo_steps_over_one_batch_record_compare_and_replay_the_routing",
        "tests/unit/training/test_moe_family.py::test_grpo_iteration_and_routing_replay_settings_that_cannot_work_are_refused",
    ],
    "TrainArgs.cpu_ranks": [
        "tests/integration/training_api/test_real_training.py::test_two_cpu_ranks_run_under_mpirun",
    ],
    "TrainArgs.launcher": [  # slurm-marked: runs only where the SLURM test cluster is
        "tests/integration/slurm/test_slurm_training.py::test_training_job_on_slurm_completes_and_publishes",
    ],
    "TrainArgs.lr_schedule": [SCHEDULE],
    "TrainArgs.min_lr_ratio": [SCHEDULE],
    "TrainArgs.weight_decay": ["tests/unit/training/test_optim.py::test_weight_decay_shrinks_matrices_only"],
    "TrainArgs.disable_dropout": [
        "tests/integration/training/test_sft_jobs.py::test_checkpoint_dropout_is_trained_and_disable_dropout_turns_it_off",
    ],
    "TrainArgs.max_grad_norm": ["tests/unit/training/test_optim.py::test_max_grad_norm_clips_the_global_norm"],
    "TrainArgs.max_seq_len": [SFT_JOB],  # the long row is cut to max_seq_len: details.data.truncated_rows == 1
    "TrainArgs.pack": [  # loop.py hands args.pack to the block stream's pack()
        "tests/unit/training/test_data.py::test_packed_documents_do_not_attend_across_and_positions_restart",
    ],
    "TrainArgs.shuffle": [  # the default (True): each epoch's blocks in a new, seeded order
        "tests/unit/training/test_data.py::test_block_stream_is_seeded_reshuffles_each_epoch_and_resumes_exactly",
    ],
    "TrainArgs.loss": [GRPO_JOB, SFT_JOB, "tests/unit/training/test_grpo.py::test_advantages_match_numpy",
                       "tests/unit/training/test_grpo.py::test_token_weights_are_each_losss_normaliser",
                       REAL_POLICY_JOB],  # cispo and sapo
    "TrainArgs.kl_coef": [
        GRPO_JOB,  # kl_coef 0.01: a kl metric, 0 at the first step and > 0 after
        "tests/unit/training/test_grpo.py::test_clipped_objective_matches_numpy",
    ],
    "TrainArgs.scale_rewards": [  # "batch": a real dr_grpo job's step divided by the batch's reward std (NumPy)
        "tests/integration/training/test_grpo_job.py::"
        "test_scale_rewards_batch_divides_by_the_std_of_every_reward_of_the_step",
        "tests/unit/training/test_grpo.py::test_advantages_match_numpy",
    ],
    "TrainArgs.mask_truncated_completions": [  # a real job's loss leaves the rows at max_tokens out (NumPy)
        "tests/integration/training/test_grpo_job.py::"
        "test_mask_truncated_completions_leaves_the_completions_at_max_tokens_out_of_the_loss",
        "tests/unit/training/test_grpo.py::"
        "test_masked_truncated_completions_weigh_nothing_as_trl_zeroes_their_completion_mask",
        "tests/unit/protocol/test_protocol_rows.py::test_mask_truncated_completions_needs_every_rows_finish_reason",
    ],
    "TrainArgs.importance_sampling_level": [  # "sequence" (GSPO): NumPy parity, packed = padded, a real job's loss
        "tests/unit/training/test_grpo.py::test_sequence_level_ratio_matches_numpy",
        "tests/unit/training/test_grpo.py::test_sequence_level_packed_gives_the_padded_loss_and_gradients",
        "tests/integration/training/test_grpo_job.py::"
        "test_importance_sampling_level_sequence_takes_one_ratio_per_completion",
    ],
    "TrainArgs.clip_eps_high": [  # rl_step.py passes it as the objective's upper clip (NumPy: clip-higher at 0.28)
        "tests/unit/training/test_grpo.py::test_clipped_objective_matches_numpy",
        "tests/unit/training/test_grpo.py::test_cispo_and_sapo_objectives_and_gradients_match_numpy",  # cispo's cap
    ],
    "TrainArgs.delta": [
        "tests/unit/training/test_grpo.py::"
        "test_delta_caps_the_unclipped_ratio_and_the_bias_corrected_kl_is_weighted_by_the_ratio",
        REAL_POLICY_JOB,
    ],
    "TrainArgs.off_policy_mask_threshold": [
        "tests/unit/training/test_grpo.py::"
        "test_off_policy_sequence_mask_leaves_out_drifted_completions_with_a_negative_advantage",
        REAL_POLICY_JOB,
    ],
    "TrainArgs.use_bias_correction_kl": [  # NumPy loss and gradient (no real job: the unit test is the whole term)
        "tests/unit/training/test_grpo.py::"
        "test_delta_caps_the_unclipped_ratio_and_the_bias_corrected_kl_is_weighted_by_the_ratio",
    ],
    "TrainArgs.sapo_temperature_pos": SAPO,
    "TrainArgs.sapo_temperature_neg": SAPO,
    "TrainArgs.vllm_importance_sampling_correction": SAMPLER_CORRECTION,
    "TrainArgs.vllm_importance_sampling_mode": SAMPLER_CORRECTION,
    "TrainArgs.vllm_importance_sampling_clip_max": SAMPLER_CORRECTION,
    "TrainArgs.vllm_importance_sampling_clip_min": SAMPLER_CORRECTION,
    "TrainArgs.clip_eps": [  # rl_step.py passes args.clip_eps as the objective's clip range
        "tests/unit/training/test_grpo.py::test_clipped_objective_matches_numpy",
    ],
    "TrainArgs.publish_dtype": [
        # "source" (the default): a bf16 base trained in fp32 is published in bf16
        "tests/integration/training/test_real_checkpoints.py::test_a_cached_hub_id_trains_and_publishes_a_real_checkpoint",
        "tests/unit/training/test_hf_io.py::test_publish_keeps_source_dtypes_and_shards",
        f"{ARG_EFFECTS}::test_publish_dtype_is_the_adapters_dtype",  # a LoRA adapter: float32, or bfloat16 when asked
    ],
    # ---- settings, top level ----
    "Settings.model": [ENGINE_FLAGS, "tests/unit/server/test_server_generate.py::test_default_max_tokens_and_base_model_by_path"],
    "Settings.home": [
        "tests/unit/test_config.py::test_defaults_are_cpu_safe",  # the queue file lives under home
        # the same home keeps the queue (and its leases) across a restart
        "tests/unit/server/test_server_openai.py::test_embedded_restart_requeues_leases_of_the_dead_worker",
    ],
    "Settings.served_model_name": [
        ENGINE_FLAGS,
        "tests/unit/inference/test_engine_settings_flags.py::test_defaults_and_lora_off",
        "tests/unit/server/test_server_openai.py::test_models_health_and_embedded_worker_lifecycle",  # /v1/models id
    ],
    "Settings.log_level": [
        "tests/unit/cli/test_log_level.py::test_serve_logs_at_the_configured_level",
        "tests/unit/cli/test_log_level.py::test_an_unknown_level_is_refused_naming_log_level",
    ],
    "Settings.hf_cache": [
        "tests/unit/checkpoint/test_hub_cache.py::test_settings_serve_a_hub_id_from_its_snapshot_under_its_name",
    ],
    # ---- server ----
    "Settings.server.host": [
        "tests/unit/cli/test_main.py::test_public_host_without_keys_is_refused",
        "tests/unit/launcher/test_notify_env.py::test_remote_trainers_use_a_configured_api_url_or_this_host",
    ],
    "Settings.server.port": [
        "tests/unit/cli/test_serve_port.py::test_port_zero_becomes_the_bound_port_in_settings",
        "tests/unit/launcher/test_notify_env.py::test_notify_url_is_this_servers_bound_port_whatever_the_role",
    ],
    "Settings.server.role": [
        SPLIT_MODE,
        "tests/integration/training_api/test_train_routes.py::test_an_embedded_nodes_gpu_job_gets_the_trainers_share_of_each_gpu",
        "tests/unit/inference/test_engine_args.py::test_shared_gpus_get_the_stated_split",
    ],
    "Settings.server.api_url": [
        "tests/unit/launcher/test_notify_env.py::test_remote_trainers_use_a_configured_api_url_or_this_host",
        "tests/integration/cluster/test_split_cluster.py::test_streaming_goes_through_the_api_to_a_remote_worker",
    ],
    "Settings.server.worker_urls": [SPLIT_MODE],  # the api forwards OpenAI requests to the worker listed there
    "Settings.server.worker_port": [
        "tests/unit/cli/test_main.py::test_serve_flags_override_file_and_defaults",  # `--role worker --port` sets it
        # workers started that way listen there and the api reaches them
        "tests/integration/cluster/test_split_cluster.py::test_streaming_goes_through_the_api_to_a_remote_worker",
    ],
    "Settings.server.api_keys": ["tests/unit/server/test_server_auth.py::test_api_keys_guard_every_route_but_health"],
    "Settings.server.api_keys_file": [
        "tests/unit/server/test_auth_internal_key.py::test_internal_key_only_announces_published_steps",
        "tests/integration/loop/test_catalog.py::test_published_notice_needs_the_admin_scope_when_keys_are_on",
    ],
    "Settings.server.worker_key_file": [  # app.py and worker_app.py read the key through worker_key(home, file)
        "tests/unit/server/test_auth_internal_key.py::test_worker_key_from_a_mounted_file_wins",
    ],
    "Settings.server.allow_insecure_public": ["tests/unit/cli/test_main.py::test_public_host_without_keys_is_refused"],
    "Settings.server.shutdown_seconds": [  # 503 while draining, exit within the drain bound
        "tests/security/test_load_and_shutdown.py::test_sigterm_drains_then_sigkill_and_restart_lose_nothing",
        "tests/security/test_shutdown_resume.py::test_sigterm_checkpoints_the_trainer_and_restart_resumes_it",
    ],
    "Settings.server.admit_factor": ["tests/unit/server/test_server_openai.py::test_beyond_capacity_is_429_with_retry_after"],
    # ---- engine (the flags vLLM is started with; their effect on a GPU cannot be shown on this CPU box) ----
    "Settings.engine.max_model_len": [
        ENGINE_FLAGS,
        "tests/unit/server/test_server_bad_input.py::test_bad_generate_requests",  # a longer prompt is a 400
    ],
    "Settings.engine.dtype": [ENGINE_FLAGS],
    "Settings.engine.kv_cache_bytes": [
        "tests/unit/inference/test_engine_args.py::test_cpu_keeps_a_user_kv_cache_size",
        "tests/unit/inference/test_engine_args.py::test_accelerator_user_settings_win",
    ],
    "Settings.engine.max_num_seqs": [ENGINE_FLAGS],
    "Settings.engine.enforce_eager": [ENGINE_FLAGS],
    "Settings.engine.tensor_parallel_size": [ENGINE_FLAGS],  # TP > 1 serving needs several accelerators
    "Settings.engine.gpu_memory_utilization": [  # GPU only: the flag reaching vLLM's engine args is what CPU shows
        "tests/unit/inference/test_engine_args.py::test_accelerator_user_settings_win",
        "tests/unit/inference/test_engine_args.py::test_split_adds_up_with_headroom",
    ],
    "Settings.engine.enable_lora": [ENGINE_FLAGS, "tests/unit/inference/test_engine_settings_flags.py::test_defaults_and_lora_off"],
    "Settings.engine.max_loras": [ENGINE_FLAGS],
    "Settings.engine.max_lora_rank": [ENGINE_FLAGS],
    "Settings.engine.seed": [ENGINE_FLAGS],
    "Settings.engine.tool_call_parser": [  # vLLM's flags, and a chat request with tools answered as vLLM's server
        PARSERS,
        "tests/integration/inference/test_openai_backend.py::test_json_reply_matches_vllm",
    ],
    "Settings.engine.reasoning_parser": [PARSERS],
    # ---- generate ----
    "Settings.generate.response_timeout": [
        f"{GENERATE}::test_long_polls_wait_response_timeout_by_default_and_never_past_max_wait_seconds",
    ],
    "Settings.generate.max_wait_seconds": [
        f"{GENERATE}::test_long_polls_wait_response_timeout_by_default_and_never_past_max_wait_seconds",
    ],
    "Settings.generate.default_max_tokens": [
        f"{GENERATE}::test_default_max_tokens_is_what_a_prompt_without_one_gets",
        "tests/unit/inference/test_sampling.py::test_defaults_are_greedy_with_configured_max_tokens",
    ],
    "Settings.generate.lease_seconds": [f"{GENERATE}::test_leases_hold_at_most_max_lease_batch_for_lease_seconds"],
    "Settings.generate.max_batch_prompts": [
        "tests/unit/server/test_server_bad_input.py::test_batch_size_limit_applies_to_json_and_upload",
    ],
    "Settings.generate.poll_interval": [  # the waits of an idle worker's pull loop
        f"{PULL_BACKOFF}::test_an_idle_worker_waits_poll_interval_then_doubles_up_to_the_cap",
        f"{PULL_BACKOFF}::test_a_poll_interval_beyond_the_cap_is_kept",
        f"{PULL_BACKOFF}::test_a_source_that_long_polled_for_poll_interval_is_asked_again_at_once",
    ],
    "Settings.generate.max_lease_batch": [f"{GENERATE}::test_leases_hold_at_most_max_lease_batch_for_lease_seconds"],
    "Settings.generate.result_retention_seconds": [
        f"{GENERATE}::test_finished_results_are_deleted_after_result_retention_seconds",
    ],
    "Settings.generate.housekeeping_interval": [
        f"{GENERATE}::test_finished_results_are_deleted_after_result_retention_seconds",
    ],
    # ---- upload (tests/unit/server/conftest.py sets 64 KiB uploads and 256 KiB request bodies) ----
    "Settings.upload.max_request_bytes": ["tests/unit/server/test_server_bad_input.py::test_oversized_json_body_is_413"],
    "Settings.upload.max_upload_bytes": [
        "tests/unit/server/test_server_bad_input.py::test_oversized_upload_is_413_declared_or_streamed",
        "tests/integration/training_api/test_chunked_upload.py::test_upload_limits_are_413",
    ],
    "Settings.upload.max_chunk_bytes": ["tests/integration/training_api/test_chunked_upload.py::test_upload_limits_are_413"],
    "Settings.upload.abandoned_upload_seconds": [
        "tests/integration/training_api/test_chunked_upload.py::"
        "test_an_upload_no_chunk_reaches_for_abandoned_upload_seconds_is_removed",
    ],
    # ---- training ----
    "Settings.training.launcher": [
        "tests/unit/inference/test_engine_args.py::test_shared_gpus_get_the_stated_split",  # local: vLLM gets 0.40
        "tests/integration/slurm/test_slurm_training.py::test_training_job_on_slurm_completes_and_publishes",
    ],
    "Settings.training.max_train_seconds": [
        TIME_LIMIT,
        "tests/unit/launcher/test_sbatch_script.py::test_time_limit_is_capped_by_the_server_setting",
    ],
    "Settings.training.cpu_ranks": [RESOURCES],  # the cpu_ranks of a job that sends none
    "Settings.training.gpus_per_node": [  # also: GPU jobs wait for free GPUs on the node
        "tests/unit/launcher/test_job_slots.py::test_gpu_jobs_wait_for_the_gpus_they_ask_for",
        RESOURCES,
        "tests/unit/launcher/test_sbatch_script.py::test_gpus_beyond_a_node_are_refused",
        "tests/unit/server/test_cluster_counts.py::test_gpu_and_node_counts_follow_the_training_settings",
    ],
    "Settings.training.nodes": [
        "tests/unit/server/test_cluster_counts.py::test_gpu_and_node_counts_follow_the_training_settings",
    ],
    "Settings.training.max_running_jobs": [
        "tests/unit/launcher/test_job_slots.py::test_jobs_past_the_limit_wait_and_start_in_order",
        "tests/unit/launcher/test_job_slots.py::test_the_control_planes_poll_starts_the_next_waiting_job",
    ],
    "Settings.training.staging_dir": [
        "tests/unit/launcher/test_notify_env.py::test_a_trainer_on_an_embedded_node_is_told_where_to_stage_full_weights",
        "tests/integration/loop/test_openai_trained.py::"
        "test_full_weights_are_served_from_the_staged_copy_and_the_same_files_land_durably",
        "tests/unit/checkpoint/test_staging.py::test_without_room_to_stage_a_step_is_published_durably_at_once",
    ],
    "Settings.training.cpu_threads": [
        "tests/unit/test_config.py::test_a_cpu_trainer_overlapping_generation_takes_half_the_cores",
        "tests/unit/training/test_cpu_threads.py::test_the_control_planes_counts_win_over_the_share_and_omp_num_threads_over_both",
        "tests/integration/loop/test_closed_loop.py::test_each_session_step_is_served_by_the_next_generate",
    ],
    "Settings.training.sbatch_options": [
        "tests/unit/launcher/test_sbatch_script.py::test_the_clusters_own_options_are_lines_of_every_jobs_script",
        "tests/unit/launcher/test_sbatch_script.py::"
        "test_an_option_the_job_sets_or_a_malformed_one_is_refused_at_startup",
        "tests/integration/slurm/test_slurm_training.py::test_training_job_on_slurm_completes_and_publishes",
        "tests/integration/slurm/test_slurm_training.py::test_a_partition_slurm_lacks_is_refused_with_sbatchs_reason",
    ],
    "Settings.training.poll_seconds": ["tests/integration/loop/test_catalog.py::test_poll_picks_up_steps_without_a_notice"],
    "Settings.training.session_idle_seconds": [
        "tests/integration/loop/test_session_idle.py::test_idle_session_ends_itself_with_state_saved",
        "tests/unit/training/test_session_poll.py::test_idle_reason_names_the_setting_and_the_saved_step",
    ],
    "Settings.training.on_shutdown": [f"{STOP_RESUME}::test_control_plane_exit_stops_or_leaves_its_trainers"],
    "Settings.training.stop_grace_seconds": [
        "tests/unit/launcher/test_stop_grace_setting.py::test_a_trainer_ignoring_sigterm_is_killed_after_stop_grace_seconds",
    ],
    "Settings.training.resume": [
        f"{STOP_RESUME}::test_resume_none_reports_interrupted_jobs_failed_with_the_way_back",
        f"{STOP_RESUME}::test_restarted_control_plane_resumes_interrupted_jobs",
        f"{STOP_RESUME}::test_crashed_jobs_resume_only_when_configured_and_at_most_max_resumes",
    ],
    "Settings.training.max_resumes": [f"{STOP_RESUME}::test_crashed_jobs_resume_only_when_configured_and_at_most_max_resumes"],
}

# Accepted fields no test shows doing anything (and no refusal): what the code does with each, and why it is open.
KNOWN_GAPS: dict[str, str] = {}


def _walk(model: type[BaseModel], prefix: str) -> list[str]:
    """Dotted names of every leaf field: a field whose type is itself a pydantic model is a section, walked into."""
    names = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            names += _walk(kind, f"{prefix}.{name}")
        else:
            names.append(f"{prefix}.{name}")
    return names


def every_field() -> set[str]:
    return {name for root, model in ROOTS.items() for name in _walk(model, root)}


def _defines(node_id: str) -> bool:
    path, _, name = node_id.partition("::")
    file = REPO / path
    return file.is_file() and re.search(rf"^(async )?def {re.escape(name)}\(", file.read_text(), re.M) is not None


def test_the_walk_reaches_every_section() -> None:
    fields = every_field()
    for section in ("lora_config", "server", "engine", "generate", "upload", "training"):
        assert any(f".{section}." in f for f in fields), section
    assert "Settings.engine" not in fields and "TrainArgs.lora_config" not in fields  # sections are not leaves


def test_every_field_has_evidence_a_refusal_or_is_a_known_gap() -> None:
    fields = every_field()
    covered = set(EVIDENCE) | set(REFUSALS)
    missing = sorted(fields - covered - set(KNOWN_GAPS))
    assert not missing, (
        f"fields with no evidence and no refusal: {missing}. Add the node ids of tests that show each one's effect "
        "to EVIDENCE in tests/unit/test_every_setting.py, or a value refused with a 400 to REFUSALS"
    )
    assert set(KNOWN_GAPS) == fields - covered, "KNOWN_GAPS must be exactly the fields without evidence or refusal"
    stale = sorted((covered | set(KNOWN_GAPS)) - fields)
    assert not stale, f"entries for fields that no longer exist: {stale}"


def test_every_cited_test_exists() -> None:
    rotten = sorted({node for nodes in EVIDENCE.values() for node in nodes if not _defines(node)})
    assert not rotten, f"cited tests that no longer exist (file gone or no `def <name>` in it): {rotten}"
    assert all(EVIDENCE.values()), "every EVIDENCE entry cites at least one test"


@pytest.mark.parametrize("field", sorted(REFUSALS))
def test_refused_values_are_a_400_naming_the_field(field: str) -> None:
    params, named = REFUSALS[field]
    with pytest.raises(InvalidRequest) as refused:
        parse_train_args(params, TrainingSettings())
    assert refused.value.status_code == 400 and named in refused.value.message, refused.value.message


@pytest.mark.parametrize(("params", "named"), MORE_REFUSALS, ids=[m[1] for m in MORE_REFUSALS])
def test_values_the_trainer_does_not_run_are_a_400_naming_them(params: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_train_args(params, TrainingSettings())
    assert refused.value.status_code == 400 and named in refused.value.message, refused.value.message
