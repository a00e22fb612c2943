"""Long operations show the same kind of bar as loading and patch_sweep (tqdm, counting work done), only when
there is more than one forward to wait for, never when progress=False, and the bar changes no result."""

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, lm_for

PROMPTS = ["the cat sat on the mat", "a dog ran", "one two three four", "blue sky", "red sun up", "x y z"]


def test_mean_difference_shows_a_bar_over_several_forwards_only(capfd):
    lm = lm_for("llama")
    quiet = ie_lab.mean_difference(lm, PROMPTS[:3], PROMPTS[3:], "resid_post.0", batch_size=1, progress=False)
    assert "mean difference" not in capfd.readouterr().err
    shown = ie_lab.mean_difference(lm, PROMPTS[:3], PROMPTS[3:], "resid_post.0", batch_size=1)
    err = capfd.readouterr().err
    assert "mean difference resid_post.0" in err and "/6 " in err, err  # the total counts every prompt
    assert torch.equal(quiet, shown)
    ie_lab.mean_difference(lm, PROMPTS[:1], PROMPTS[1:2], "resid_post.0")  # one forward a side: nothing to show
    assert "mean difference" not in capfd.readouterr().err
    assert_clean(lm)


def test_fit_tuned_lens_shows_a_bar_once_a_second_forward_starts(capfd):
    lm = lm_for("llama")
    quiet = ie_lab.fit_tuned_lens(lm, PROMPTS, layers=[0], batch_size=2, progress=False)
    assert "fitting tuned lens" not in capfd.readouterr().err
    shown = ie_lab.fit_tuned_lens(lm, PROMPTS, layers=[0], batch_size=2)
    err = capfd.readouterr().err
    assert "fitting tuned lens" in err and "/6 " in err, err  # the total counts every prompt
    for L in quiet.transports:
        assert all(torch.equal(a, b) for a, b in zip(quiet.transports[L], shown.transports[L]))
    ie_lab.fit_tuned_lens(lm, iter(PROMPTS), layers=[0], batch_size=2)  # a generator: counted, no total
    assert "fitting tuned lens" in capfd.readouterr().err
    ie_lab.fit_tuned_lens(lm, PROMPTS[:2], layers=[0])  # one forward: nothing to show
    assert "fitting tuned lens" not in capfd.readouterr().err
    assert_clean(lm)


@pytest.mark.parametrize("call", ["mean_difference", "fit_tuned_lens"])
def test_progress_must_be_a_bool(call):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match="progress must be True or False"):
        if call == "mean_difference":
            ie_lab.mean_difference(lm, PROMPTS[:1], PROMPTS[1:2], "resid_post.0", progress="no")
        else:
            ie_lab.fit_tuned_lens(lm, PROMPTS, layers=[0], progress="no")
    assert_clean(lm)
