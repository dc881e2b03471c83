from evolution_ingest.cli import main

main(prog_name="evolution-ingest")
