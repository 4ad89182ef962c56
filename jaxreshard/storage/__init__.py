"""Reading and writing arrays with Orbax in whichever process holds them (the driver, or a Ray
host actor): the I/O under `jaxreshard.checkpoint`, beside `comm`'s data plane."""
