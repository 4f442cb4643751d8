"""HTTP edge and the `strata` command line."""
