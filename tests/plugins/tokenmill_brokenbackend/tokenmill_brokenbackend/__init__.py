"""A deliberately broken attention backend, contributed by a plugin (see backend.py)."""
