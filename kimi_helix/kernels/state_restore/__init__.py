"""The KDA rollback after a verify step from device counts (an asynchronous DSpark round's), dispatched by the op
switch."""

from __future__ import annotations

from kimi_helix.kernels.backends import op_backend
from kimi_helix.kernels.state_restore.naive import restore_verified_states_ref


def restore_verified_states(recurrent_pools, conv_pools, states, inputs, conv_before, slots, accepted, group,
                            scratch_at=None, *, backend=None) -> None:  # fmt: skip
    """In place: recurrent_pools [L, S, H, K, V] and conv_pools [L, S, W - 1, C] at slots [N] from the verify
    scratch (states [L, R, H, K, V], inputs [L, R, C], conv_before [L, R', W - 1, C]) after accepted [N] drafts
    of each group of `group` tokens, the groups at rows i * group and i or at scratch_at [N, 2]; see
    `restore_verified_states_ref`. The backend is chosen on conv_pools' dtype."""
    if op_backend("restore_verified_states", conv_pools, forced=backend) == "triton":
        from kimi_helix.kernels.state_restore.triton import restore_verified_states_triton as fn
    else:
        fn = restore_verified_states_ref
    fn(recurrent_pools, conv_pools, states, inputs, conv_before, slots, accepted, group, scratch_at)


__all__ = ["restore_verified_states", "restore_verified_states_ref"]
