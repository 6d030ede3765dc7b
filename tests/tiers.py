"""The slow tier: the tests `make test-fast` leaves out, beside those marked `@pytest.mark.slow` in their file.

Listed here, by file, rather than marked in place so that the tier is read (and changed) in one place while
several people edit the test files. Chosen by measurement, not by guess: every test function that took 1.5 s or
more (all its parameters together; a shared launch counted where it is paid) in a `--durations=0` run of the
rest of the suite on the 2-core development machine at load 11-21 (2026-12-07): process launches (ranks,
torchrun, supervised jobs, servers, CLIs in a subprocess) and long in-process work (512-rank simulations,
hypothesis searches, the 1,000-message fuzz). The tests main gained later (multi-host, GPU, trust) were measured
the same way on 2026-12-07 08:54-08:58 at load 2-5, in one run of the files they touched. Tests that share one
launch (a module fixture, an lru_cache) are in the same tier, so the fast tier never pays a launch the slow tests
were meant to pay. conftest.py adds the marker, to these and to every test marked `browser` (headless chromium:
skipped where it is not installed, so absent from the measurement); tests/test_tiers.py checks every name here
still names a test.
"""
from __future__ import annotations

ALL = "*"  # every test of the file

SLOW: dict[str, str | tuple[str, ...]] = {
    "test_bench_dpp_real_smoke.py": ("test_quick_run_produces_numbers",),  # 21 s
    "test_bench_engine_smoke.py": ("test_quick_run_produces_ratios_and_equal_losses",),  # 9 s
    "test_bench_harness.py": ("test_launch_collects_reports_in_rank_order_and_the_fence_spans_the_slowest_rank",),
    "test_bench_lamb_batch_smoke.py": ("test_same_tokens_quarter_steps",),
    "test_bench_stats.py": ("test_interval_covers_the_true_ratio_and_shrinks_with_samples",),
    "test_checkpoint.py": ("test_async_save_writes_what_a_sync_save_writes_and_keeps_the_newest",
                           "test_overlapped_snapshot_holds_the_state_of_the_save_call_bit_for_bit"),
    "test_comm_regimes.py": ("test_eager_streams_stall_the_column_layout_at_pp3_and_not_the_links",
                             "test_lazy_creation_blocks_the_column_layout_at_pp2_and_not_the_links"),
    "test_comm_semantics.py": ALL,  # one 2-rank launch of every case (module fixture): 16 s
    "test_config_cli.py": ("test_help_lists_every_command", "test_static_schedules_never_deadlock"),
    "test_device_spec.py": ("test_any_spec_is_accepted_within_bounds_or_refused_by_name",),  # hypothesis
    "test_dpp_plot_cli.py": ("test_cli_simulate_prints_a_table_and_draws", "test_png_and_html_from_a_simulation"),
    "test_dpp_policies.py": ("test_every_shape_completes_within_the_cap",),
    "test_dpp_simulator.py": ("test_scale_pp64_512_microbatches",),
    "test_eager_optim.py": ("test_a_training_rank_never_imports_the_compiler_stack",),  # 9 s
    "test_engine_imports.py": ("test_a_run_with_modules_off_loads_no_module_code",),
    "test_export.py": ("test_export_loads_in_transformers_with_equal_logits_and_reexports_identically",),
    "test_faults.py": ("test_slow_link_delays_sends_and_collectives",
                       "test_slow_wire_delivers_late_in_order_without_stalling_the_sender"),
    "test_fbd_layout.py": ("test_weight_plan_moves_backward_shards_into_forward_shards",),
    "test_gpu_check.py": ("test_a_gpu_that_torch_cannot_use_fails_the_check",  # the check script, in a subprocess
                          "test_without_a_gpu_every_check_says_why_it_skips"),
    "test_hosts.py": ALL,  # hosts as network namespaces (root): torchrun across them, 110 s
    "test_launch.py": ("test_a_finished_rank_with_a_daemon_thread_in_torch_exits_cleanly",
                       "test_forked_ranks_see_the_launchers_environment_of_the_moment_and_start_with_torch_loaded",
                       "test_forked_ranks_write_to_the_launchers_output_of_the_moment",  # 2 s
                       "test_rank_killed_by_signal_is_named_and_local_jobs_listen_on_loopback_only"),
    "test_optim.py": ("test_lamb_tensor_parallel_equals_unsharded",),
    "test_resilience.py": ALL,  # supervised 4-rank runs and their baseline: 92 s
    "test_resilience_inplace.py": ALL,  # 8-rank jobs with spares and their uninterrupted reference: 47 s, +31 s
    # for the two survivors stopped while a generation starts (2026-12-07 11:13, load 3)
    "test_resilience_diagnose.py": ("test_diagnose_names_the_injected_slow_link_on_real_ranks",
                                    "test_diagnostics_over_their_budget_are_stopped_and_name_the_ranks_without_results",
                                    "test_group_probe_names_the_slow_ring_link_on_real_ranks"),
    "test_resilience_zero_buddy.py": (  # 3 ranks under 3 comm modes; an 8-rank ZeRO job and its baseline: 33 s
        "test_each_rank_keeps_its_wards_slice_and_a_hand_over_restores_a_rank_under_every_comm_mode",
        "test_zero_ranks_killed_mid_step_take_their_slices_from_buddies_bit_identical"),
    "test_resilience_multihost_unit.py": ("test_driver_names_the_rank_whose_heartbeat_stopped_and_decides",),
    "test_resilience_shrink.py": ("test_a_hung_replica_is_diagnosed_evicted_and_the_run_finishes_on_dp1",),  # 53 s
    "test_resilience_stragglers.py": ("test_healthy_supervised_run_reports_no_straggler",
                                      "test_slow_rank_is_a_persistent_straggler_and_is_evicted"),  # 100 s
    "test_scan_anyjob.py": ALL,  # one launch per job kind, shared (lru_cache)
    "test_scan_detect.py": ("test_every_finding_of_the_perturbed_real_family_prints",),
    "test_scan_hang.py": ALL,
    "test_scan_kineto.py": (  # one shared recording: 78 s
        "test_real_profiler_traces_name_the_faulty_rank_first_and_nothing_persistent_on_healthy_jobs",
        "test_collectives_match_across_ranks_with_group_size_and_instance_number",
        "test_cli_views_accept_a_profiler_trace_directory"),
    "test_scan_kinds.py": ("test_real_kineto_faults_are_one_finding_of_the_right_kind",),
    "test_scan_rank_summary.py": ("test_simulated_summaries_equal_the_spans_numbers",),
    "test_scan_real.py": ALL,  # one launch per layout and fault (module fixture): 23 s
    "test_scan_ring.py": ("test_dp_and_tp_pairs_named_at_1024_ranks", "test_healthy_1024_ranks_quiet"),
    "test_scan_stages.py": ("test_heavier_last_stage_is_no_fault", "test_slow_heavy_stage_is_still_found",
                            "test_per_layer_spans_name_a_slow_lone_stage_the_flops_model_hides"),  # shared runs
    "test_scan_tracer.py": ("test_instrument_plain_torch_loop", "test_instrument_returns_real_work_and_traces_ddp",
                            "test_instrument_covers_all_to_all_rooted_and_functional_collectives"),
    "test_scan_two_level.py": ("test_two_level_finds_what_the_full_detector_finds",  # 512-rank simulations
                               "test_triage_scores_the_faulty_rank_on_the_right_feature", "test_cli_two_level",
                               "test_aggregate_only_flagged_two_level_writes_the_flagged_ranks",
                               "test_two_level_names_the_rank_a_hung_job_waits_for",
                               "test_a_second_file_claiming_a_rank_is_ignored_as_read_dir_does",
                               "test_span_estimate_counts_spans_not_bytes",
                               "test_batches_by_slot_reduce_as_span_by_span",
                               "test_summary_and_heatmap_two_level_show_the_ranks_read"),
    "test_scope_faults.py": ("test_fuzz_1000_messages_one_rank",),
    "test_scope_pp.py": ALL,
    "test_scope_starvation.py": ALL,
    "test_scope_tp.py": ("test_tp2_serving_matches_single_process",),
    "test_scope_training.py": ("test_console_pauses_steps_once_and_resumes",),
    "test_tensor_parallel.py": ("test_tp2_matches_single_process_with_and_without_sequence_parallel",),
    "test_trust_fuzz.py": ("test_config_files",  # hypothesis
                           "test_new_formats_under_a_memory_cap"),  # children under a memory cap: 9 s
    "test_trust_hf.py": ("test_a_config_claiming_more_than_the_tensors_hold_is_refused_before_allocation",),
    "test_trust_resume.py": ("test_resumed_copy_imports_nothing_named_by_its_checkpoint_and_writes_into_the_copy",
                             "test_a_torn_shard_or_a_false_zero_claim_is_an_error_naming_the_file_not_a_traceback"),
    "test_trust_save_drill.py": (
        "test_kill_9_at_each_stage_of_an_async_save_under_torchrun_resumes_the_newest_full_step_bit_identically",),
    "test_trust_startup.py": ALL,
    "test_trust_traces.py": ("test_a_summary_block_claiming_2000_iterations_of_a_huge_world_is_refused_under_1_gb",),
    "test_vocab_padding.py": ("test_tp2_loss_sampling_and_hf_parity_with_full_gpt2_vocab",),
}


def is_slow(file_name: str, function: str) -> bool:
    """Whether test `function` of tests/`file_name` is in the slow tier by this list."""
    listed = SLOW.get(file_name, ())
    return listed == ALL or function in listed
