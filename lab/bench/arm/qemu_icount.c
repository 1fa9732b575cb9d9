/* A qemu TCG plugin (qemu-user 7.2 to 8.x: plugin API version 1) that counts the guest instructions a program executes
 * and prints "instructions N" to stderr at its exit: lab/bench/arm.py's measure of the aarch64 build, where no Arm CPU
 * is at hand to time it. Each translated block adds its instruction count to one counter inline as it runs (one vCPU:
 * the driver runs the kernel on one thread). Only the few declarations of qemu's plugin API it uses are written
 * here. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*tb_translated)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*at_exit)(qemu_plugin_id_t id, void *data);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, tb_translated callback);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr,
                                              uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, at_exit callback, void *data);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;
static uint64_t executed;

static void translated(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &executed, qemu_plugin_tb_n_insns(tb));
}
static void finished(qemu_plugin_id_t id, void *data) {
    (void)id, (void)data;
    fprintf(stderr, "instructions %llu\n", (unsigned long long)executed);
}
__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const void *info, int argc,
                                                               char **argv) {
    (void)info, (void)argc, (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, translated);
    qemu_plugin_register_atexit_cb(id, finished, NULL);
    return 0;
}
