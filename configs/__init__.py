if __name__ == "configs":  # the checkout's folder imported by its own name: not the installed package
    raise ImportError("import composer_mesh.configs, not configs: the packages install as composer_mesh.* "
                      "(python3 -m mesh.bootstrap setup; docs/installation.md)")
