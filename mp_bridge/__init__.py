"""mp_bridge: model-parallel building blocks for colocated multimodal (MIMO) models.

Subpackages: ``grid`` (rank geometry, groups), ``comm`` (collectives, bridge, partition),
``layers`` (vocab-parallel layers and losses), ``models`` (reference models),
``testing`` (multi-process test kit).
"""

__version__ = "0.1.0"
