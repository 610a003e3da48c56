"""The deprecated constructor form of :class:`~.mimo.ColocatedMimoModel` (one release).

Old form: ``ColocatedMimoModel(encoder, projection, llm, bridge, partition, *,
image_token_id, encoder_dp_group=None, llm_dp_cp_group=None, groups=None, flow=...)``.
It warns (``DeprecationWarning``) and becomes the new form: one :class:`MimoGroups` (the
``groups`` given, or :func:`~.mimo_groups.groups_of_bridge` around the bridge, DP groups left
out looked up on its grids) and the ``partition`` given.
"""

from __future__ import annotations

from collections.abc import Mapping

from mp_bridge.comm import PartitionAdapter
from mp_bridge.deprecations import warn_deprecated
from mp_bridge.models.colocated.mimo_groups import MimoGroups, groups_of_bridge

__all__ = ["KEYWORDS", "legacy_groups"]

#: The old form's keywords the new signature no longer names.
KEYWORDS = ("encoder_dp_group", "llm_dp_cp_group", "groups")

#: How the old form names the DP groups in errors.
DP_NAMES = {"encoder_dp": "encoder_dp_group", "llm_dp_cp": "llm_dp_cp_group"}


def legacy_groups(
    bridge: object, partition: object, *, encoder, llm, keywords: Mapping[str, object]
) -> MimoGroups:
    """The :class:`MimoGroups` of an old-form call (warns; local lookups only)."""
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"ColocatedMimoModel got unexpected keyword arguments {unknown}")
    if isinstance(bridge, MimoGroups):
        raise TypeError(
            "ColocatedMimoModel(encoder, projection, llm, groups) takes no partition, "
            f"{', '.join(KEYWORDS)}: the MimoGroups holds them"
        )
    warn_deprecated(
        "mp_bridge.models.ColocatedMimoModel(encoder, projection, llm, bridge, partition)",
        stacklevel=4,
    )
    if not isinstance(partition, PartitionAdapter):
        raise TypeError(
            f"partition must be a PartitionAdapter, got {partition!r}; or pass one "
            "MimoGroups instead of bridge and partition"
        )
    given = keywords.get("groups")
    if given is not None and not isinstance(given, MimoGroups):
        raise TypeError(f"groups must be a MimoGroups (make_mimo_groups), got {given!r}")
    encoder_dp = keywords.get("encoder_dp_group")
    llm_dp_cp = keywords.get("llm_dp_cp_group")
    if given is not None:
        if given.bridge is bridge and encoder_dp is None and llm_dp_cp is None:
            return given  # the old from_groups call: its groups, grids and all
        encoder_dp = given.encoder_dp if encoder_dp is None else encoder_dp
        llm_dp_cp = given.llm_dp_cp if llm_dp_cp is None else llm_dp_cp
    return groups_of_bridge(
        bridge, encoder_tp=encoder.tp_group, llm_tp=llm.tp_group, llm_cp=llm.cp_group,
        encoder_dp=encoder_dp, llm_dp_cp=llm_dp_cp,
    )  # fmt: skip
