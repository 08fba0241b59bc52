"""What every family shares: the decoder and its layers (torch), its torch-free shape (shape.py, the base of each
family's spec), and its parallel plan. A family's folder subclasses or re-exports these; nothing outside a family's
folder imports that family's modules (the registry and models/build.py find them by name)."""
