/* kvh-store remote ...: the remote tier's keys of one model (see
 * tools/kvh_store_remote.c). */
#ifndef KVH_TOOLS_KVH_STORE_REMOTE_H
#define KVH_TOOLS_KVH_STORE_REMOTE_H

/* argv[1] is "remote"; returns the exit status. */
int kvh_store_remote_main(int argc, char **argv);

#endif
