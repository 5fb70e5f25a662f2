from posttrain.lit.tools.cli import main

main()
