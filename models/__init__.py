"""Network definitions, checkpoint key mapping and fast paths installed on them."""
