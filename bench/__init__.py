"""Benchmarks: drivers that start stages and apps and measure them (`omniserve bench`). Nothing served imports them."""
