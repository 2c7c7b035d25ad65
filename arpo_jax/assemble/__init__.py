"""Config -> a run's parts: validation of a whole config against every stage's settings (`validate`), the files a
command needs (`files`), and the settings, engines and tools a run is built from (`components`)."""
