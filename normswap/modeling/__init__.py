"""Model classes: the self-contained RMSNorm modeling file and helpers to build models."""
