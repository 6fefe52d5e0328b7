"""The rotate command's choices, kept free of torch so that the CLI can offer them at start-up."""

from __future__ import annotations

from normswap.checkpoint.provenance import ROTATION_FORMS, ROTATION_METHODS

# how Q is made: randomised Hadamard, seeded random orthogonal, or the stream's principal directions
METHODS = ROTATION_METHODS
# at most this many calibration tokens are read (pca and --slice)
DEFAULT_CALIBRATION_TOKENS = 32768
# the form of a rotation: commuting (Q·1 = 1, the stock LayerNorm kept, the original model type) or
# free (any orthogonal Q on the centred RMSNorm conversion, model type normswap_<type>)
FORMS = ROTATION_FORMS
DEFAULT_FORM = "commuting"
