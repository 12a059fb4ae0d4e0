"""The wire between the front-end process and the engine-core process: message structs, the
parameters and outputs they carry, and the socket addresses of one link. Plain data only; both
processes import it, and it imports neither."""
