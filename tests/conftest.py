from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import Embedder
from tests.helpers import make_random_checkpoint


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny"
    make_random_checkpoint(folder)
    return folder


@pytest.fixture
def tiny_embedder(tiny_checkpoint: Path) -> Embedder:
    return Embedder.from_folder(tiny_checkpoint, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def minilm() -> Embedder:
    """The real all-MiniLM-L6-v2 from the installed package (CI installs it)."""
    return Embedder.load(device="cpu", dtype="float32")


# The two tiers. `make check` runs `pytest -m "not slow"`: the tests that start no real
# process, drive no browser or load balancer, and take well under a second each. `make test`
# runs everything. The modules below belong to the full tier whole (a real server, a browser,
# HAProxy or wrk in every test): the fast tier does not even import them. The tests after
# them are marked here, by what `pytest --durations` showed: each over about a second, or
# starting processes of its own. So is every test run against the split placement, which
# starts an engine process.
FULL_TIER_PATHS = (
    "tests/browser/",
    "tests/app/test_remote_engine.py",  # an engine process per test
    "tests/app/test_clients.py",
    "tests/app/test_server_process.py",
    "tests/app/test_signals.py",
    "tests/app/test_slow_clients.py",
    "tests/app/test_split.py",
    "tests/bench/test_frontend_cost.py",  # a front end in a process of its own
    "tests/bench/test_server.py",  # the ceiling in a process of its own
    "tests/bench/test_soak.py",
    "tests/deploy/test_compose_topology.py",
    "tests/docs/test_examples.py",
)
FULL_TIER_TESTS: dict[str, set[str]] = {
    "tests/app/test_cores.py": {"test_a_worker_killed_mid_pass_blocks_nobody"},
    "tests/bench/test_wrk.py": {"test_wrk_counts_answers_of_the_wrong_shape_as_bad"},
    # Real timeouts waited out.
    "tests/app/test_limits.py": {"test_request_timeout", "test_body_timeout"},
    # Servers started as processes, to see them fail.
    "tests/app/test_models.py": {
        "test_a_model_that_cannot_load_fails_the_start_with_its_name",
        "test_a_server_over_its_memory_budget_refuses_to_start",
        # Three models' servers, and each model's alone, on every route.
        "test_each_model_answers_as_it_does_alone",
        "test_requests_to_three_models_interleave_without_cross_talk",
    },
    # Property tests of a second or more (the others stay in the fast tier).
    "tests/app/test_properties.py": {
        "test_no_body_gets_a_5xx_or_a_traceback",
        "test_any_text_gets_a_vector_or_says_why",
    },
    "tests/app/test_chunking.py": {
        "test_a_document_of_100000_characters_is_answered_or_refused_with_413"
    },
    "tests/app/test_faults.py": {"test_start_up_objects_are_frozen_out_of_the_cyclic_collector"},
    # schemathesis over every operation, per model.
    "tests/app/test_contract.py": {"test_the_service_keeps_its_published_contract"},
    # The real model against sentence-transformers or transformers, or in another dtype.
    "tests/model/test_parity_sentence_transformers.py": {
        "test_all_minilm_matches_sentence_transformers"
    },
    "tests/model/test_bfloat16.py": {"test_bfloat16_keeps_every_cosine_above_0_999"},
    # Graphs compiled by inductor: seconds to tens of seconds each.
    "tests/model/test_compiled.py": {
        "test_compiled_passes_give_the_eager_vectors_and_compile_nothing_more",
        "test_passes_of_up_to_max_tokens_run_on_the_graphs_and_larger_ones_as_timed",
        "test_an_embedding_models_pipeline_runs_in_its_graphs",
        "test_a_single_inputs_graph_attends_with_no_mask_and_takes_no_padding",
        "test_int8_passes_compile_with_rowwise_layers",
        "test_a_pass_runs_on_the_graph_of_its_thread_count",
        "test_a_one_token_input_and_unexpected_segment_ids_run_eagerly",
        "test_attention_maps_come_from_the_eager_pass",
        "test_prepacked_layers_compile_on_the_checkpoints_weights",
        "test_a_pair_model_compiles_its_passes_with_segment_ids",
        "test_masks_narrowed_by_a_sliding_window_compile",
        "test_a_pass_that_cannot_be_compiled_refuses_to_start",
    },
    "tests/app/test_routes.py": {"test_a_compiled_server_answers_as_the_model_does"},
    "tests/model/test_int8.py": {"test_minilm_in_int8_stays_close_to_float32"},
    "tests/model/test_folders.py": {
        "test_folder_saved_by_sentence_transformers",
        "test_folder_in_the_older_format",
        "test_transformer_weights_in_every_format_give_the_same_vectors",
        "test_info_reports_what_the_folder_holds",
        "test_do_lower_case_saved_by_sentence_transformers",
        "test_do_lower_case_in_the_older_format",
        "test_do_lower_case_adds_no_lowercase_to_a_tokenizer_that_has_one",
        "test_truncate_dim_is_the_default_and_a_request_can_ask_for_fewer",
        "test_truncate_dim_with_a_trailing_normalize_gives_unit_vectors",
    },
    "tests/model/test_pairs.py": {
        "test_pairs_are_tokenized_as_whole_texts_truncated_longest_first"
    },
    "tests/model/test_parity_cross_sparse.py": {
        "test_sparse_encoder_pooling_settings",
        "test_cross_encoder_whose_tokenizer_gives_no_segment_ids",
    },
}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast tier (`-m "not slow"`) leaves the full tier's modules unimported: importing
    them (the clients, the browser driver) costs seconds of a run meant to take one minute."""
    if config.getoption("markexpr") != "not slow":
        return None
    relative = collection_path.relative_to(config.rootpath).as_posix()
    return relative.startswith(FULL_TIER_PATHS) or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the full tier's tests `slow` (see above)."""
    root = config.rootpath
    for item in items:
        module = item.path.relative_to(root).as_posix()
        name = getattr(item, "originalname", item.name)
        callspec = getattr(item, "callspec", None)
        split = callspec is not None and callspec.params.get("placement") == "split"
        if split or module.startswith(FULL_TIER_PATHS) or name in FULL_TIER_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)
