"""Portable kernels shared by backend plugins (no vendor names in the model or HAL)."""
