"""FX passes over traced kvcompile models, each (gm, example_inputs) -> gm (later issues)."""
