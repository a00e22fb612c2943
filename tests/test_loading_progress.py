"""Loading shows one ie_lab progress bar, never transformers' own ("Loading weights ..."), and leaves the
user's global transformers / huggingface_hub progress-bar settings exactly as it found them."""

import pytest
from transformers.utils import logging as hf_logging

import ie_lab
from tests.families import saved_model_dir


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_model_dir("qwen3", tmp_path_factory.mktemp("models"))


@pytest.fixture
def bars_on():
    """transformers' bars globally on (its default), whatever an earlier test left."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield
    (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_session_with_progress_false_shows_no_bar_at_all(saved, bars_on, capfd):
    with ie_lab.Session(saved, progress=False) as s:
        assert s.generate("a b", max_new_tokens=1) is not None
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err, err
    assert "loading model" not in out + err, err
    assert hf_logging.is_progress_bar_enabled(), "the global transformers setting was left off"


def test_session_with_progress_true_shows_only_ie_labs_bar(saved, bars_on, capfd):
    with ie_lab.Session(saved, progress=True):
        pass
    out, err = capfd.readouterr()
    assert "loading model" in err, err
    assert "Loading weights" not in out + err, err
    assert hf_logging.is_progress_bar_enabled()


def test_load_hides_transformers_bar_and_restores_both_settings(saved, capfd):
    from huggingface_hub.utils import are_progress_bars_disabled

    was_tf, was_hub = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    try:
        for tf_on in (True, False):
            (hf_logging.enable_progress_bar if tf_on else hf_logging.disable_progress_bar)()
            lm = ie_lab.load(saved, quiet=True)
            assert lm is not None
            out, err = capfd.readouterr()
            assert "Loading weights" not in out + err, err
            assert hf_logging.is_progress_bar_enabled() is tf_on
            assert are_progress_bars_disabled() is (not tf_on)
    finally:
        (hf_logging.enable_progress_bar if was_tf else hf_logging.disable_progress_bar)()
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

        (disable_progress_bars if was_hub else enable_progress_bars)()


def test_a_failed_load_restores_the_setting(tmp_path, bars_on):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception):
        ie_lab.load(str(tmp_path), quiet=True)
    assert hf_logging.is_progress_bar_enabled()
