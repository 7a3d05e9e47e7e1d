"""Each product sheet (``/work/shared/seeds``) against its preset (SPEC section 12): the
sheet's own sample code, run unchanged, and every frame, header and code the sheet states."""
