"""GNSConfig (gns_kernels/distributed/config.py): checked once, each bad argument named;
a state built from a config equals the one the keyword constructor builds."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gns_kernels.distributed import GNSConfig, GNSHookState, MicroBatchGNS
from gns_kernels.distributed.config import unique_params

PARAMS = list(torch.nn.Linear(4, 3).parameters())


@pytest.mark.parametrize("kwargs, error, match", [
    ({"geometry": "l3"}, ValueError, r"^geometry: expected one of \('l2', 'l1', 'nuclear'\), got 'l3'"),
    ({"shift": "first"}, ValueError, r"^shift: the only string accepted is 'last', got 'first'"),
    ({"shift": 1.0}, TypeError, r"^shift: expected None, 'last', a mapping .* got float"),
    ({"params": PARAMS[0]}, TypeError, r"^params: expected an iterable of parameters, got a single tensor"),
    ({"params": [PARAMS[0], "bias"]}, TypeError, r"^params\[1\]: expected a parameter tensor, got str"),
    ({"params": []}, ValueError, r"^params: expected at least one parameter, got an empty iterable"),
    ({"nuclear_dof": "data"}, ValueError,
     r"^nuclear_dof: expected one of \('auto', 'gauss-sums', 'columns'\) .*'data' needs cross-sample"),
    ({"signal": "unbiased"}, ValueError, r"^signal: expected 'raw'.*'debiased', got 'unbiased'"),
    ({"pool_beta": 1.0}, ValueError, r"^pool_beta: expected None or a number in \[0, 1\)"),
    ({"pool_beta": "0.9"}, TypeError, r"^pool_beta: expected None or a number in \[0, 1\), got str"),
    ({"method": "newton-tf32"}, ValueError, r"^method: 'newton-tf32' is not accepted by the hook states"),
    ({"method": "svd"}, ValueError,
     r"^method: expected one of \('auto', 'eigh', 'newton', 'host'\) or a HostConfig, got 'svd'"),
])
def test_each_bad_argument_is_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        GNSConfig(**kwargs)
    # the keyword constructor raises the same error (it builds the config)
    with pytest.raises(error, match=match):
        GNSHookState(batch_size=8, **kwargs)


def test_a_good_config_is_normalized_once_and_frozen():
    w, b = PARAMS
    cfg = GNSConfig("nuclear", params=iter([w, b, w]), bias_correction=0, pool_beta=0)
    assert cfg.params == (w, b)            # a generator, read once; the tied weight once
    assert cfg.bias_correction is False and cfg.pool_beta == 0.0
    assert not cfg.pooled                  # no pool without the correction
    assert GNSConfig("l1").pooled and not GNSConfig("l2").pooled
    assert GNSConfig("l1", signal="debiased").l1_debiased
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.geometry = "l1"
    # replace checks again
    with pytest.raises(ValueError, match="^method: expected one of"):
        dataclasses.replace(cfg, method="svd")
    assert dataclasses.replace(cfg, method="eigh").params == (w, b)


def test_gauss_sums_on_too_few_ranks_is_refused_by_the_config(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="^nuclear_dof: 'gauss-sums' needs at least 3 ranks"):
            GNSConfig("nuclear", nuclear_dof="gauss-sums")
        GNSConfig("nuclear", nuclear_dof="gauss-sums", bias_correction=False)
    finally:
        dist.destroy_process_group()


def test_equality_compares_tensors_by_identity():
    other = list(torch.nn.Linear(4, 3).parameters())
    assert GNSConfig(params=PARAMS) == GNSConfig(params=list(PARAMS))
    assert GNSConfig(params=PARAMS) != GNSConfig(params=other)       # no elementwise ==
    shift = {p: torch.zeros_like(p) for p in PARAMS}
    assert GNSConfig(shift=shift) == GNSConfig(shift=shift)
    assert GNSConfig(shift=shift) != GNSConfig(shift=dict(shift))
    assert GNSConfig(shift="last") == GNSConfig(shift="last")
    assert GNSConfig(method="eigh") != GNSConfig()


def _same_state(a: GNSHookState, b: GNSHookState) -> None:
    assert type(a) is type(b) and a.config == b.config
    assert repr(a) == repr(b)
    for name in ("geometry", "every", "batch_size", "step", "grad_scale", "shift", "process_group",
                 "bias_correction", "nuclear_dof", "signal", "pool_beta", "method",
                 "has_param_order", "l1_debiased", "synced_backwards", "estimate", "estimate_step"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.pool is None) == (b.pool is None)
    assert [a.pool_key(p) for p in PARAMS] == [b.pool_key(p) for p in PARAMS]
    assert [a.measures(p) for p in PARAMS] == [b.measures(p) for p in PARAMS]


@pytest.mark.parametrize("kwargs", [
    {"geometry": "l1"},
    {"geometry": "nuclear", "params": PARAMS, "nuclear_dof": "columns", "signal": "debiased",
     "method": "eigh"},
    {"geometry": "l2", "shift": "last", "bias_correction": False, "pool_beta": None},
])
def test_from_config_equals_the_keyword_constructor(kwargs):
    a = GNSHookState(every=7, batch_size=32, **kwargs)
    config = GNSConfig(**kwargs)
    b = GNSHookState.from_config(config, every=7, batch_size=32)
    assert b.config is config
    _same_state(a, b)
    assert a.state_dict().keys() == b.state_dict().keys()


def test_microbatch_from_config():
    kw = dict(geometry="l1", signal="debiased", pool_beta=0.5)
    a = MicroBatchGNS(PARAMS, every=3, batch_size=8, micro_batches=2, **kw)
    b = MicroBatchGNS.from_config(GNSConfig(params=PARAMS, **kw), every=3, batch_size=8,
                                  micro_batches=2)
    _same_state(a, b)
    assert a.micro_batches == b.micro_batches == 2 and b.micro_batch_samples
    # what MicroBatchGNS refuses of a config, named
    with pytest.raises(ValueError, match="^params: MicroBatchGNS reads the .grad of config.params"):
        MicroBatchGNS.from_config(GNSConfig(), batch_size=8, micro_batches=2)
    with pytest.raises(ValueError, match="^shift: MicroBatchGNS has no shift"):
        MicroBatchGNS.from_config(GNSConfig(params=PARAMS, shift="last"), batch_size=8, micro_batches=2)
    with pytest.raises(ValueError, match=r"^nuclear_dof: expected one of \('auto', 'columns'\) for MicroBatchGNS"):
        MicroBatchGNS.from_config(GNSConfig(params=PARAMS, nuclear_dof="gauss-sums"), batch_size=8,
                                  micro_batches=2)
    with pytest.raises(ValueError, match="^micro_batches"):
        MicroBatchGNS.from_config(GNSConfig(params=PARAMS), batch_size=8)
    # its keyword constructor keeps its own message for 'data'
    with pytest.raises(ValueError, match=r"^nuclear_dof: expected one of \('auto', 'columns'\) for "
                                         r"MicroBatchGNS, got 'data' \('gauss-sums' needs"):
        MicroBatchGNS(PARAMS, batch_size=8, micro_batches=2, nuclear_dof="data")


def test_from_config_refuses_other_objects_and_checks_the_schedule():
    with pytest.raises(TypeError, match="^config: expected a GNSConfig, got dict"):
        GNSHookState.from_config({"geometry": "l1"}, batch_size=8)
    with pytest.raises(ValueError, match="^batch_size: expected the global batch size"):
        GNSHookState.from_config(GNSConfig())
    with pytest.raises(ValueError, match="^every: expected an int >= 1, got 0"):
        GNSHookState.from_config(GNSConfig(), every=0, batch_size=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'micro_batches'"):
        GNSHookState.from_config(GNSConfig(), batch_size=8, micro_batches=2)


def test_settings_are_the_configs():
    st = GNSHookState("nuclear", batch_size=8, params=PARAMS)
    cfg = st.config
    assert (st.geometry, st.signal, st.pool_beta) == (cfg.geometry, cfg.signal, cfg.pool_beta)
    with pytest.raises(AttributeError):
        st.geometry = "l1"                     # read-only: the config is frozen
    st.method = "eigh"                         # the one settable setting: a new config
    assert st.method == st.config.method == "eigh" and st.config is not cfg
    assert cfg.method == "auto"                # the old config is unchanged
    assert dataclasses.replace(st.config, method="auto") == cfg
    with pytest.raises(ValueError, match="^method: 'newton-tf32'"):
        st.method = "newton-tf32"
    assert st.config.method == "eigh"          # a refused value leaves it


def test_unique_params_keeps_order_and_drops_repeats():
    w, b = PARAMS
    assert unique_params([b, w, b]) == (b, w)
    assert unique_params(()) == ()
