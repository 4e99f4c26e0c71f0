int kvs_placeholder(void) { return 0; }
