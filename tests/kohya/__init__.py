"""Tests of sd-scripts behaviour kept for kohya users: options, file names, captions, presets."""
